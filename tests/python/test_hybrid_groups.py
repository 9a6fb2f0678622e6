"""KV-cache groups through the bindings: FullAttention / SlidingWindow specs, kv_groups=, the
group= views with -1 at released positions, prefix hits every group can serve, and hostile
arguments (docs/design.md, KV groups)."""

import copy
import pickle

import numpy as np
import pagedkv
import pytest
from pagedkv import FullAttention, InvalidArgumentError, KvCacheManager, SlidingWindow


def hybrid(window: int = 4, *, num_blocks: int = 64, block_size: int = 2, **kw: object) -> KvCacheManager:
    return KvCacheManager(
        num_blocks, block_size, kv_groups=[FullAttention(), SlidingWindow(window=window)], **kw
    )


def test_specs_are_small_frozen_values() -> None:
    assert repr(FullAttention()) == "FullAttention()"
    assert repr(SlidingWindow(window=512)) == "SlidingWindow(window=512)"
    assert SlidingWindow(window=4) == SlidingWindow(window=4) != SlidingWindow(window=5)
    assert FullAttention() == FullAttention() != SlidingWindow(window=4)
    assert len({SlidingWindow(window=4), SlidingWindow(window=4), FullAttention()}) == 2
    assert SlidingWindow(window=7).window == 7
    with pytest.raises(AttributeError):
        SlidingWindow(window=7).window = 8  # type: ignore[misc]
    assert eval(repr(SlidingWindow(window=9)), vars(pagedkv)) == SlidingWindow(window=9)
    assert pagedkv.FullAttention is FullAttention and "SlidingWindow" in pagedkv.__all__


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_specs_pickle_and_copy_at_every_protocol(protocol: int) -> None:
    # SlidingWindow raised TypeError ("cannot pickle") where FullAttention pickled: a spec list
    # could not cross a process boundary (multiprocessing, a config sent to a worker).
    groups = [FullAttention(), SlidingWindow(window=4096), SlidingWindow(window=1)]
    restored = pickle.loads(pickle.dumps(groups, protocol))
    assert restored == groups and [type(g) for g in restored] == [type(g) for g in groups]
    assert copy.deepcopy(groups) == groups and copy.copy(groups[1]) == groups[1]
    assert hybrid(window=4).kv_groups == pickle.loads(pickle.dumps(hybrid(window=4).kv_groups, protocol))
    assert KvCacheManager(8, 2, kv_groups=restored).kv_groups == groups


@pytest.mark.parametrize("window", [0, -1, 2**70, 3.0, True, "4", None])
def test_bad_windows_are_invalid_arguments(window: object) -> None:
    with pytest.raises(InvalidArgumentError):
        SlidingWindow(window=window)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kv_groups",
    [
        [],
        (),
        [1],
        [None],
        [FullAttention, SlidingWindow],  # the classes, not instances
        "full",
        FullAttention(),
        {FullAttention()},
        [FullAttention()] * 65,
    ],
)
def test_bad_kv_groups_are_invalid_arguments(kv_groups: object) -> None:
    with pytest.raises(InvalidArgumentError):
        KvCacheManager(16, 2, kv_groups=kv_groups)  # type: ignore[arg-type]


def test_default_is_one_full_attention_group() -> None:
    kv = KvCacheManager(8, 2)
    assert kv.kv_groups == [FullAttention()]
    kv.add_sequence(1, [1, 2, 3])
    np.testing.assert_array_equal(kv.block_table(1, group=0), kv.block_table(1))
    for call in (
        lambda: kv.block_table(1, group=1),
        lambda: kv.batch_block_tables([1], group=1),
        lambda: kv.csr_page_table([1], group=1),
        lambda: kv.slot_mapping([1], 1, group=1),
    ):
        with pytest.raises(InvalidArgumentError):
            call()
    # An explicit single full group is the same plain manager.
    same = KvCacheManager(8, 2, kv_groups=(FullAttention(),))
    same.add_sequence(1, [1, 2, 3])
    np.testing.assert_array_equal(same.block_table(1), kv.block_table(1))


@pytest.mark.parametrize("group", [2, -1, 2**64, 1.0, True, "0", None])
def test_out_of_range_or_malformed_group_is_invalid(group: object) -> None:
    kv = hybrid()
    kv.add_sequence(1, [1, 2, 3, 4, 5])
    for call in (
        lambda: kv.block_table(1, group=group),  # type: ignore[arg-type]
        lambda: kv.batch_block_tables([1], group=group),  # type: ignore[arg-type]
        lambda: kv.csr_page_table([1], group=group),  # type: ignore[arg-type]
        lambda: kv.slot_mapping([1], 1, group=group),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidArgumentError):
            call()
    kv.check_invariants()


def test_window_release_shows_minus_one_in_every_view() -> None:
    kv = hybrid(window=3)
    kv.add_sequence(1, [1, 2, 3, 4, 5])  # 3 blocks per group
    assert kv.stats()["num_blocks_in_use"] == 6
    kv.append_tokens(1, [6])  # 5 computed tokens: the window group releases block 0
    window_table = kv.block_table(1, group=1)
    assert window_table[0] == -1 and (window_table[1:] >= 0).all()
    assert (kv.block_table(1, group=0) >= 0).all()
    assert kv.stats()["num_blocks_in_use"] == 5
    tables, lens = kv.batch_block_tables([1], group=1)
    np.testing.assert_array_equal(tables[0], window_table)
    assert lens.tolist() == [6]
    indptr, indices, last = kv.csr_page_table([1], group=1)
    assert indptr.tolist() == [0, 3] and indices.tolist() == window_table.tolist()
    assert last.tolist() == [2]
    slots = kv.slot_mapping([1], 6, group=1)
    assert slots[:2].tolist() == [-1, -1]
    assert slots[2:].tolist() == [int(window_table[1]) * 2, int(window_table[1]) * 2 + 1, *slots[4:].tolist()]
    assert (kv.slot_mapping([1], 6, group=0) >= 0).all()
    kv.check_invariants()


def test_long_decode_keeps_the_window_group_bounded() -> None:
    kv = hybrid(window=8, num_blocks=256, block_size=4)
    kv.add_sequence(1, list(range(10)))
    for t in range(200):
        kv.append_tokens(1, [t])
        kv.check_invariants()
    live = kv.block_table(1, group=1)
    # cdiv(window - 1, block) + the block being written, at most one more at a boundary.
    assert (live >= 0).sum() <= 4
    assert (kv.block_table(1, group=0) >= 0).all()


def test_prefix_hit_needs_only_the_window_blocks() -> None:
    kv = hybrid(window=4, enable_prefix_caching=True)  # 2 blocks before the hit point
    prompt = list(range(20))
    kv.add_sequence(1, prompt)
    kv.append_tokens(1, [99])  # watermark 20: the window group releases blocks 0-7
    kv.free(1)
    assert kv.match_prefix(prompt + [7]) == 20
    assert kv.add_sequence(2, prompt + [7]) == 20
    table = kv.block_table(2, group=1)
    assert (table[:8] == -1).all() and (table[8:] >= 0).all()
    assert (kv.block_table(2, group=0) >= 0).all()
    kv.check_invariants()


def test_fork_shares_nulls_and_truncate_refuses_released_blocks() -> None:
    kv = hybrid(window=3)
    kv.add_sequence(1, [1, 2, 3, 4, 5, 6, 7])
    kv.append_tokens(1, [8])
    kv.fork(1, 2)
    np.testing.assert_array_equal(kv.block_table(1, group=1), kv.block_table(2, group=1))
    assert kv.block_table(2, group=1)[0] == -1
    with pytest.raises(InvalidArgumentError):
        kv.truncate(2, 3)  # the window at 3 tokens reads released block 0
    assert kv.num_tokens(2) == 8
    kv.truncate(2, 7)
    kv.append_tokens(2, [9])
    ops = kv.take_copy_ops()
    assert ops.shape[1] == 2
    kv.free_batch([1, 2])
    kv.check_invariants()
    assert kv.stats()["num_blocks_in_use"] == 0


def test_swap_moves_only_live_entries() -> None:
    kv = hybrid(window=3, num_host_blocks=16)
    kv.add_sequence(1, [1, 2, 3, 4, 5])
    kv.append_tokens(1, [6])
    live = int((kv.block_table(1, group=0) >= 0).sum() + (kv.block_table(1, group=1) >= 0).sum())
    out = kv.swap_out([1])
    assert out.shape == (live, 2)
    assert kv.stats()["num_blocks_in_use"] == 0
    back = kv.swap_in([1])
    assert back.shape == (live, 2)
    assert kv.block_table(1, group=1)[0] == -1
    kv.check_invariants()


def test_out_of_blocks_counts_every_group() -> None:
    kv = hybrid(window=4, num_blocks=6, block_size=2)
    assert kv.blocks_needed_for_prompt(5) == 6
    kv.add_sequence(1, [1, 2, 3, 4, 5])  # 3 blocks in each group: the pool is full
    assert not kv.can_append(1, 2)
    with pytest.raises(pagedkv.OutOfBlocksError):
        kv.add_sequence(2, [1])
    with pytest.raises(InvalidArgumentError):
        kv.add_sequence(3, list(range(7)))  # 4 blocks per group can never fit 6
    kv.check_invariants()
