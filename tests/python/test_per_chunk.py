"""Per-chunk allocation through the bindings (docs/design.md, Per-chunk allocation): vLLM's
``allocate_slots`` contract, admission with ``reserve_prompt=False``, ids given later, lookahead
and rollback, per-step deltas, the null block, caller-supplied keys and hashes, and the
argument checks of every new keyword. The semantics are checked exhaustively against a reference
model by ``rust/pagedkv/tests/model.rs``; these tests pin the Python surface."""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
from pagedkv import FullAttention, InvalidArgumentError, KvCacheManager, OutOfBlocksError, SlidingWindow


def test_a_prompt_is_allocated_chunk_by_chunk() -> None:
    kv = KvCacheManager(16, 4)
    prompt = list(range(20))  # 5 blocks
    assert kv.add_sequence(1, prompt, num_scheduled=6, reserve_prompt=False) == 0
    assert (len(kv.block_table(1)), kv.num_slots(1), kv.num_computed_tokens(1), kv.num_tokens(1)) == (
        2,
        8,
        6,
        20,
    )
    assert kv.allocate_slots(1, 6) is True
    assert (len(kv.block_table(1)), kv.num_computed_tokens(1)) == (3, 12)
    assert kv.allocate_slots(1, 8) is True  # the rest of the prompt
    assert kv.allocate_slots(1, 1) is True  # the first decode step
    assert (kv.num_tokens(1), kv.num_computed_tokens(1), len(kv.block_table(1))) == (21, 21, 6)
    kv.check_invariants()


def test_a_refusal_is_false_and_changes_nothing() -> None:
    kv = KvCacheManager(4, 4)
    kv.add_sequence(1, num_tokens=8)  # 2 blocks
    kv.add_sequence(2, num_tokens=8)  # the other 2
    before = (kv.block_table(1).tolist(), kv.num_computed_tokens(1), kv.stats())
    assert kv.allocate_slots(1, 1) is False
    assert (kv.block_table(1).tolist(), kv.num_computed_tokens(1), kv.stats()) == before
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(1, 100)  # can never fit the pool
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(1, 1, num_computed_tokens=9)  # past the manager's watermark
    with pytest.raises(pagedkv.UnknownSequenceError):
        kv.allocate_slots(7, 1)


def test_admission_checks_the_whole_prompt_with_window_caps_and_the_watermark() -> None:
    groups = [FullAttention(), SlidingWindow(window=8)]
    kv = KvCacheManager(20, 4, kv_groups=groups, max_model_len=64, max_in_flight_tokens=8, watermark_blocks=2)
    # Full group: 10 blocks for 40 tokens; window group capped at cdiv(7 + 8, 4) + 1 = 5; watermark 2.
    with pytest.raises(OutOfBlocksError) as err:
        kv.add_sequence(1, list(range(60)), num_scheduled=4, reserve_prompt=False)
    assert err.value.args  # 15 + 5 + 2 > 20
    assert kv.add_sequence(1, list(range(40)), num_scheduled=4, reserve_prompt=False) == 0
    assert [len(kv.block_table(1, group=g)) for g in range(2)] == [1, 1]
    with pytest.raises(InvalidArgumentError):
        kv.add_sequence(2, list(range(65)), reserve_prompt=False)  # longer than max_model_len
    kv.check_invariants()


def test_require_full_prompt_false_checks_only_the_scheduled_chunk() -> None:
    # vLLM's allocate_slots(..., full_sequence_must_fit=False): the chunk and the watermark must
    # fit now, the whole prompt need not (not even the pool, when max_model_len allows it).
    kv = KvCacheManager(8, 4, enable_prefix_caching=True, max_model_len=64, watermark_blocks=1)
    kv.add_sequence(1, list(range(100, 112)))  # 3 blocks: 5 available
    prompt = list(range(40))  # 10 blocks
    before = kv.stats()
    with pytest.raises(InvalidArgumentError):  # the whole prompt passes the pool
        kv.add_sequence(2, prompt, num_scheduled=8, reserve_prompt=False)
    with pytest.raises(OutOfBlocksError):  # 5 blocks + the watermark > 5
        kv.add_sequence(2, prompt, num_scheduled=20, reserve_prompt=False, require_full_prompt=False)
    with pytest.raises(InvalidArgumentError):  # 9 blocks: the chunk alone passes the pool
        kv.add_sequence(2, prompt, num_scheduled=36, reserve_prompt=False, require_full_prompt=False)
    assert kv.stats() == before
    assert kv.add_sequence(2, prompt, num_scheduled=16, reserve_prompt=False, require_full_prompt=False) == 0
    assert (len(kv.block_table(2)), kv.num_computed_tokens(2), kv.num_tokens(2)) == (4, 16, 40)
    assert kv.allocate_slots(2, 4) is True  # the last available block (no watermark past admission)
    before = kv.stats()
    assert kv.allocate_slots(2, 4) is False  # the rest of the prompt does not fit: vLLM preempts
    assert kv.stats() == before
    kv.check_invariants()


def test_a_prompt_past_the_pool_is_bounded_by_max_model_len_without_the_whole_prompt_check() -> None:
    prompt, hashes = list(range(40)), list(range(1, 11))  # 10 blocks, a pool of 8

    def admit(
        kv: KvCacheManager, seq_id: int, tokens: list[int], block_hashes: list[int] | None = None
    ) -> int:
        return kv.add_sequence(
            seq_id,
            tokens,
            num_scheduled=4,
            reserve_prompt=False,
            require_full_prompt=False,
            block_hashes=block_hashes,
        )

    kv = KvCacheManager(8, 4, enable_prefix_caching=True, max_model_len=64)
    assert admit(kv, 1, prompt, hashes) == 0
    with pytest.raises(InvalidArgumentError):  # past max_model_len
        admit(kv, 2, list(range(68)))
    unbounded = KvCacheManager(8, 4, enable_prefix_caching=True)  # no max_model_len: the pool bounds
    with pytest.raises(InvalidArgumentError):
        admit(unbounded, 1, prompt)
    assert unbounded.num_sequences == 0
    kv.check_invariants()


def test_window_release_waits_for_in_flight_tokens() -> None:
    kv = KvCacheManager(64, 2, kv_groups=[FullAttention(), SlidingWindow(window=3)])
    kv.add_sequence(1, num_tokens=20, num_scheduled=20, reserve_prompt=False)
    assert kv.allocate_slots(1, 1, num_in_flight_tokens=20) is True  # nothing processed yet
    assert -1 not in kv.block_table(1, group=1).tolist()
    assert kv.allocate_slots(1, 1) is True  # processed 21: blocks before 21 - 3 + 1 = 19 go
    table = kv.block_table(1, group=1).tolist()
    assert table[:9] == [-1] * 9 and -1 not in table[9:]
    assert -1 not in kv.block_table(1, group=0).tolist()
    kv.check_invariants()


def test_ids_given_later_index_their_blocks_then() -> None:
    kv = KvCacheManager(16, 2, enable_prefix_caching=True, enable_kv_events=True)
    kv.add_sequence(1, [1, 2, 3])
    kv.take_events()
    assert kv.allocate_slots(1, 1) is True  # token 4's id is sampled later
    assert kv.match_prefix([1, 2, 3, 4, 5]) == 2
    assert kv.take_events() == []
    kv.provide_token_ids(1, [4])
    assert kv.match_prefix([1, 2, 3, 4, 5]) == 4
    assert [type(e).__name__ for e in kv.take_events()] == ["BlockStored"]
    with pytest.raises(InvalidArgumentError):
        kv.provide_token_ids(1, [5, 6, 7])  # past the slots it holds
    kv.check_invariants()


def test_lookahead_slots_are_never_hashed_and_drafts_roll_back() -> None:
    kv = KvCacheManager(16, 2, enable_prefix_caching=True)
    kv.add_sequence(1, [1, 2, 3])
    assert kv.allocate_slots(1, 3, num_lookahead_tokens=2) is True  # 1 + 2 drafts, 2 lookahead
    assert (kv.num_computed_tokens(1), kv.num_slots(1)) == (6, 8)
    kv.provide_token_ids(1, [4, 5])  # one draft accepted: ids of verified tokens only
    assert kv.allocate_slots(1, 1, num_computed_tokens=5) is True  # the other draft rejected
    assert (kv.num_computed_tokens(1), kv.num_slots(1)) == (6, 8)  # blocks of drafts kept
    assert kv.match_prefix([1, 2, 3, 4, 9]) == 4
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(1, 1, num_computed_tokens=1)  # below the indexed blocks
    kv.check_invariants()


def test_ids_after_rejected_drafts_roll_the_watermark_back_first() -> None:
    def step(rollback: bool) -> int:
        kv = KvCacheManager(16, 2, enable_prefix_caching=True)
        kv.add_sequence(1, [1, 2, 3])
        kv.provide_token_ids(1, [4])  # the prompt's sampled token
        assert kv.allocate_slots(1, 3) is True  # token 4 and 2 drafts: positions 3-5
        # One draft accepted (id 5 at position 4), a bonus token (6) at position 5: the K/V at
        # position 5 is the rejected draft's, so block [4, 6) must not be indexed yet.
        kv.provide_token_ids(1, [5, 6], num_computed_tokens=5 if rollback else None)
        kv.check_invariants()
        return int(kv.match_prefix([1, 2, 3, 4, 5, 6, 7]))

    assert step(rollback=True) == 4
    assert step(rollback=False) == 6  # what the keyword is for: the stale watermark indexes it


def test_new_block_ids_patch_a_runners_tables() -> None:
    kv = KvCacheManager(
        32, 2, kv_groups=[FullAttention(), SlidingWindow(window=2)], record_new_block_ids=True
    )
    kv.add_sequence(3, num_tokens=5, num_scheduled=3, reserve_prompt=False)
    seq_ids, groups, positions, block_ids, fresh = kv.take_new_block_ids()
    assert seq_ids.dtype == np.uint64 and groups.dtype == positions.dtype == block_ids.dtype == np.int32
    assert fresh.dtype == np.bool_ and fresh.all()
    tables: dict[tuple[int, int], list[int]] = {}

    def patch() -> None:
        for s, g, p, b in zip(*kv.take_new_block_ids()[:4], strict=True):
            t = tables.setdefault((int(s), int(g)), [])
            t.extend([-2] * (int(p) + 1 - len(t)))
            t[int(p)] = int(b)

    for s, g, _position, b in zip(seq_ids, groups, positions, block_ids, strict=True):
        tables.setdefault((int(s), int(g)), []).append(int(b))
    for _ in range(6):
        assert kv.allocate_slots(3, 1) is True
        patch()
    for g in range(2):
        assert tables[(3, g)] == kv.block_table(3, group=g).tolist()
    assert -1 in tables[(3, 1)]  # released positions come through as the null value
    assert [len(a) for a in KvCacheManager(8, 2).take_new_block_ids()] == [0] * 5  # log off


def test_null_block_zero_takes_vllms_numbering() -> None:
    kv = KvCacheManager(16, 2, kv_groups=[FullAttention(), SlidingWindow(window=2)], null_block=0)
    assert kv.null_block == 0 and kv.refcount(0) == 1
    assert kv.num_free_blocks == 15 and kv.stats()["num_reserved_blocks"] == 1
    kv.add_sequence(1, num_tokens=6)
    kv.append_tokens(1, num_tokens=1)  # watermark 6: the window releases blocks 0-1
    assert 0 not in kv.block_table(1, group=0).tolist()
    assert kv.block_table(1, group=1).tolist()[:2] == [0, 0]
    tables, _ = kv.batch_block_tables([1], group=1)
    assert tables[0, :2].tolist() == [0, 0]
    assert kv.usage == pytest.approx(kv.stats()["num_blocks_in_use"] / 15)
    kv.check_invariants()
    pool = pagedkv.BlockPool(8, 2)
    pool.allocate(1)  # block 0 taken: no null block there
    with pytest.raises(InvalidArgumentError):
        KvCacheManager(pool=pool, null_block=0)
    for bad in (1, -2, True, "0", 0.0):
        with pytest.raises(InvalidArgumentError):
            KvCacheManager(8, 2, null_block=bad)


def test_caller_hashes_key_the_index_and_the_events() -> None:
    kv = KvCacheManager(16, 2, enable_prefix_caching=True, enable_kv_events=True)
    digests = [bytes([i]) * 32 for i in range(1, 3)]
    hashes = [pagedkv.reduce_block_hash(d) for d in digests]
    assert hashes[0] == int.from_bytes(digests[0][:16], "little")
    kv.add_sequence(1, [1, 2, 3, 4, 5], block_hashes=digests)  # bytes are reduced on the way in
    (stored,) = kv.take_events()
    assert stored.block_hashes == hashes
    assert kv.match_prefix([1, 2, 3, 4, 9], block_hashes=hashes) == 4
    assert kv.match_prefix([1, 2, 3, 4, 9]) == 0  # pagedkv's own hashes differ
    assert kv.add_sequence(2, [1, 2, 3, 4, 9], block_hashes=hashes) == 4
    with pytest.raises(InvalidArgumentError):
        kv.add_sequence(3, [1, 2, 3], block_hashes=[1, 2])  # one full block only
    with pytest.raises(InvalidArgumentError):
        kv.add_sequence(3, num_tokens=4, block_hashes=[1])  # hashes need token ids
    with pytest.raises(InvalidArgumentError):
        kv.add_sequence(3, [1, 2], block_hashes=[1 << 128])
    with pytest.raises(InvalidArgumentError):
        pagedkv.reduce_block_hash("ab")  # type: ignore[arg-type]
    kv.check_invariants()


def test_block_extra_keys_separate_namespaces_per_block() -> None:
    kv = KvCacheManager(16, 2, enable_prefix_caching=True)
    kv.add_sequence(1, [1, 2, 3, 4, 5], block_extra_keys=[None, "image-a"])
    assert kv.match_prefix([1, 2, 3, 4, 9], block_extra_keys=[None, "image-a"]) == 4
    assert kv.match_prefix([1, 2, 3, 4, 9], block_extra_keys=[None, "image-b"]) == 2
    assert kv.match_prefix([1, 2, 3, 4, 9]) == 2
    for bad in ([1.5], "ab", [None, None, None, None]):
        with pytest.raises(InvalidArgumentError):
            kv.add_sequence(5, [1, 2, 3, 4, 5], block_extra_keys=bad)  # type: ignore[arg-type]
    kv.check_invariants()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_model_len": -1},
        {"max_model_len": 0},
        {"max_in_flight_tokens": 1.5},
        {"watermark_blocks": True},
        {"record_new_block_ids": 2},
    ],
)
def test_bad_constructor_limits_are_invalid_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        KvCacheManager(8, 2, **kwargs)  # type: ignore[arg-type]
