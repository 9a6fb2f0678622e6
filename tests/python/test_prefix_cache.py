"""Prefix caching through Python (docs/design.md, Prefix cache): exact scenarios with block ids, refcounts,
eviction orders and the KV-event sequence asserted.

Pool conventions these scenarios rely on: a fresh pool hands out blocks 0, 1, 2, ... in order;
truly free blocks are used before any cached block is evicted; cached blocks are evicted least
recently used first, a sequence's tail blocks ahead of its head blocks.
"""

from __future__ import annotations

import pagedkv
import pytest
from kv_test_helpers import snapshot
from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, OutOfBlocksError

BS = 4  # block size of every scenario


def manager(num_blocks: int, **kwargs: object) -> pagedkv.KvCacheManager:
    kwargs.setdefault("enable_kv_events", True)
    return pagedkv.KvCacheManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=True, **kwargs)  # type: ignore[arg-type]


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def stored_hashes(events: list[object]) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed_hashes(events: list[object]) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_miss_then_hit_three_full_blocks_and_a_partial() -> None:
    kv = manager(16)
    prompt = tokens(100, 3 * BS + 2)
    assert kv.add_sequence(1, prompt) == 0
    assert kv.block_table(1).tolist() == [0, 1, 2, 3]
    assert kv.add_sequence(2, prompt) == 3 * BS  # the partial block is never shared
    assert kv.block_table(2).tolist() == [0, 1, 2, 4]
    assert [kv.refcount(b) for b in range(5)] == [2, 2, 2, 1, 1]
    stats = kv.stats()
    assert stats["prefix_query_tokens"] == 2 * len(prompt)
    assert stats["prefix_hit_tokens"] == 3 * BS
    assert stats["prefix_hit_rate"] == pytest.approx(12 / 28)
    assert stats["num_blocks_in_use"] == 5
    kv.check_invariants()


def test_the_whole_prompt_is_never_served_from_cache() -> None:
    kv = manager(16)
    prompt = tokens(0, 2 * BS)  # exactly two full blocks
    kv.add_sequence(1, prompt)
    assert kv.add_sequence(2, prompt) == BS  # the last token must be computed
    assert kv.block_table(2).tolist()[0] == kv.block_table(1).tolist()[0]
    assert kv.block_table(2).tolist()[1] != kv.block_table(1).tolist()[1]


def test_requests_sharing_a_prefix_share_physical_blocks() -> None:
    kv = manager(16)
    system = tokens(500, 2 * BS)
    assert kv.add_sequence(1, system + [1, 2, 3]) == 0
    assert kv.add_sequence(2, system + [7, 8, 9, 10, 11]) == 2 * BS
    t1, t2 = kv.block_table(1).tolist(), kv.block_table(2).tolist()
    assert t1[:2] == t2[:2] == [0, 1] and t1[2] != t2[2]
    assert kv.refcount(0) == kv.refcount(1) == 2
    kv.check_invariants()


def test_hit_after_both_are_freed_lazy_eviction() -> None:
    kv = manager(16)
    prompt = tokens(100, 3 * BS + 2)
    kv.add_sequence(1, prompt)
    kv.add_sequence(2, prompt)
    kv.free(1)
    kv.free(2)
    stats = kv.stats()
    assert stats["num_blocks_in_use"] == 0 and stats["num_cached_blocks"] == 3
    assert kv.num_free_blocks == 16  # cached blocks count as allocatable
    assert [kv.refcount(b) for b in range(3)] == [0, 0, 0]
    assert kv.add_sequence(3, prompt) == 3 * BS  # revived: 0 -> 1
    assert kv.block_table(3).tolist()[:3] == [0, 1, 2]
    assert [kv.refcount(b) for b in range(3)] == [1, 1, 1]
    assert kv.stats()["num_cached_blocks"] == 0 and kv.stats()["evictions"] == 0
    kv.check_invariants()


def test_exact_eviction_order_under_pressure() -> None:
    kv = manager(8)
    a, b = tokens(100, 2 * BS), tokens(200, 2 * BS)
    kv.add_sequence(1, a)  # blocks 0, 1
    kv.add_sequence(2, b)  # blocks 2, 3
    kv.free(1)  # LRU order: 1 (A tail), 0 (A head)
    kv.free(2)  # then 3 (B tail), 2 (B head)
    kv.take_events()
    given = []
    # One-block prompts of fresh content: four truly free blocks first, then evictions.
    for seq_id in range(10, 18):
        kv.add_sequence(seq_id, tokens(1000 + 10 * seq_id, BS - 1))
        given.append(kv.block_table(seq_id).tolist()[0])
    assert given == [4, 5, 6, 7, 1, 0, 3, 2]
    assert kv.stats()["evictions"] == 4
    removed = removed_hashes(kv.take_events())
    assert len(removed) == 4 and len(set(removed)) == 4
    kv.check_invariants()


def test_hit_blocks_are_not_evicted_while_other_free_blocks_exist() -> None:
    kv = manager(4)
    a = tokens(100, 2 * BS)
    kv.add_sequence(1, a)  # blocks 0, 1
    kv.add_sequence(2, tokens(300, BS))  # block 2
    kv.free(1)  # cached, LRU first: 1, 0
    kv.free(2)  # cached: 2; block 3 is truly free
    # 4 blocks: 2 hits (the LRU-first cached blocks!) + 2 fresh: block 3, then evict block 2.
    assert kv.add_sequence(3, a + tokens(900, 2 * BS)) == 2 * BS
    assert kv.block_table(3).tolist() == [0, 1, 3, 2]
    assert kv.stats()["evictions"] == 1
    kv.check_invariants()


def test_a_reused_block_loses_its_stale_hash() -> None:
    kv = manager(2)
    a = tokens(100, BS + 1)
    kv.add_sequence(1, a)  # blocks 0 (full, indexed) and 1
    kv.free(1)
    kv.take_events()
    kv.add_sequence(2, tokens(700, 2 * BS))  # needs both blocks: evicts block 0
    assert sorted(kv.block_table(2).tolist()) == [0, 1]
    events = kv.take_events()
    assert len(removed_hashes(events)) == 1
    kv.free(2)
    assert kv.add_sequence(3, a) == 0  # A's content is gone: no stale hit
    kv.check_invariants()


def test_caching_disabled_gives_no_hits() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    prompt = tokens(0, 3 * BS + 1)
    assert kv.add_sequence(1, prompt) == 0
    assert kv.add_sequence(2, prompt) == 0
    assert not set(kv.block_table(1).tolist()) & set(kv.block_table(2).tolist())
    kv.free(1)
    assert kv.stats()["num_cached_blocks"] == 0 and kv.take_events() == []
    assert kv.stats()["prefix_hit_tokens"] == 0


def test_salt_isolation() -> None:
    kv = manager(32)
    prompt = tokens(0, 2 * BS + 1)
    assert kv.add_sequence(1, prompt, extra_key="tenant-a") == 0
    assert kv.add_sequence(2, prompt, extra_key="tenant-b") == 0
    assert kv.add_sequence(3, prompt) == 0
    assert kv.add_sequence(4, prompt, extra_key="tenant-a") == 2 * BS
    assert kv.block_table(4).tolist()[:2] == kv.block_table(1).tolist()[:2]
    # str keys hash as UTF-8 and ints as their decimal text: documented equivalences.
    assert kv.add_sequence(5, prompt, extra_key=b"tenant-b") == 2 * BS
    kv.add_sequence(6, prompt, extra_key=7)
    assert kv.add_sequence(7, prompt, extra_key="7") == 2 * BS
    kv.check_invariants()


def test_failed_allocation_leaves_refcounts_and_lru_untouched() -> None:
    kv = manager(6)
    a = tokens(100, 2 * BS)
    kv.add_sequence(1, a)  # blocks 0, 1
    kv.add_sequence(2, tokens(300, BS))  # block 2, stays live
    kv.free(1)  # cached: 1, 0
    kv.take_events()
    before = snapshot(kv, [1, 2, 3])
    # 2 hits + 4 fresh needed, but only 3 truly free blocks (3, 4, 5) and no other cached one.
    with pytest.raises(OutOfBlocksError) as info:
        kv.add_sequence(3, a + tokens(900, 4 * BS))
    assert info.value.blocks_short == 1  # type: ignore[attr-defined]
    assert snapshot(kv, [1, 2, 3]) == before
    assert kv.take_events() == []
    assert [kv.refcount(0), kv.refcount(1)] == [0, 0]
    # The LRU order is unchanged: after the free blocks, block 1 is evicted before block 0.
    order = []
    for seq_id in range(10, 15):
        kv.add_sequence(seq_id, tokens(2000 + 10 * seq_id, 1))
        order.append(kv.block_table(seq_id).tolist()[0])
    assert order == [3, 4, 5, 1, 0]
    kv.check_invariants()


def test_decode_filled_blocks_become_hittable() -> None:
    kv = manager(16)
    prompt = tokens(100, BS + 2)
    kv.add_sequence(1, prompt)  # one full block, one partial
    kv.append_tokens(1, [7, 8])  # fills the second block
    kv.append_tokens(1, [9])  # and starts a third
    assert kv.add_sequence(2, prompt + [7, 8, 9]) == 2 * BS
    assert kv.block_table(2).tolist()[:2] == kv.block_table(1).tolist()[:2]
    # Id-less growth cannot be hashed: it never becomes hittable.
    kv.add_sequence(3, tokens(500, BS - 1))
    kv.append_tokens(3, num_tokens=2)
    assert kv.add_sequence(4, tokens(500, BS - 1) + [0, 0, 5]) == 0
    kv.check_invariants()


def test_event_sequence_store_evict_store_reset() -> None:
    kv = manager(2, hash_seed=1234)
    a = tokens(100, 2 * BS)
    kv.add_sequence(1, a)
    events = kv.take_events()
    assert all(isinstance(e, BlockStored) for e in events)
    first = [e for e in events if isinstance(e, BlockStored)]
    hashes_a = stored_hashes(events)
    assert len(hashes_a) == 2 and len(set(hashes_a)) == 2
    assert all(isinstance(h, int) for h in hashes_a)
    assert first[0].parent_block_hash is None and first[0].block_size == BS
    assert [t for e in first for t in e.token_ids] == a
    assert first[0].medium == "GPU" and first[0].lora_id is None
    if len(first) == 2:  # one event per block: the second chains to the first
        assert first[1].parent_block_hash == hashes_a[0]
    assert kv.reset_prefix_cache() is False  # blocks in use: refused, nothing recorded
    assert kv.take_events() == []
    kv.free(1)
    kv.add_sequence(2, tokens(700, 2 * BS))  # evicts A's tail, then its head
    events = kv.take_events()
    assert removed_hashes(events) == [hashes_a[1], hashes_a[0]]
    hashes_b = stored_hashes(events)
    assert len(hashes_b) == 2 and not set(hashes_b) & set(hashes_a)
    kinds = [type(e).__name__ for e in events]
    last_removed = max(i for i, k in enumerate(kinds) if k == "BlockRemoved")
    assert all(k == "BlockStored" for k in kinds[last_removed + 1 :]) and kinds[-1] == "BlockStored"
    kv.free(2)
    assert kv.reset_prefix_cache() is True
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.stats()["num_cached_blocks"] == 0 and kv.num_free_blocks == 2
    assert kv.add_sequence(3, tokens(700, 2 * BS)) == 0  # the index is empty
    kv.check_invariants()


def test_drained_events_are_what_their_constructors_build() -> None:
    # take_events builds the frozen dataclasses without running __init__ (object.__new__ and
    # the fields in __dict__, as copy.copy does): each must be indistinguishable from the
    # object __init__ builds from its fields, and still frozen.
    import dataclasses

    kv = manager(3)
    kv.add_sequence(1, tokens(100, 2 * BS), extra_key=b"salt")
    kv.free(1)
    kv.add_sequence(2, tokens(700, 2 * BS + 1))
    kv.free(2)
    assert kv.reset_prefix_cache() is True
    events = kv.take_events()
    assert {type(e) for e in events} == {BlockStored, BlockRemoved, AllBlocksCleared}
    for event in events:
        fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
        twin = type(event)(**fields)
        assert event == twin and hash(event) == hash(twin)
        assert list(vars(event).items()) == list(vars(twin).items())  # same fields, same order
        assert repr(event) == repr(twin)
        if fields:
            with pytest.raises(dataclasses.FrozenInstanceError):
                event.medium = "CPU"  # type: ignore[misc]
    salted = [e for e in events if isinstance(e, BlockStored) and e.extra_keys is not None]
    assert salted and salted[0].extra_keys == [(b"salt",)] * len(salted[0].block_hashes)


def test_hashes_are_reproducible_per_seed() -> None:
    def hashes(seed: int) -> list[int]:
        kv = manager(8, hash_seed=seed)
        kv.add_sequence(1, tokens(0, 2 * BS), extra_key="x")
        return stored_hashes(kv.take_events())

    assert hashes(1) == hashes(1)
    assert hashes(1) != hashes(2)
    assert all(0 <= h < 2**128 for h in hashes(1))


def test_bounded_event_queue_counts_drops() -> None:
    kv = manager(64, max_events=2)
    for seq_id in range(5):
        kv.add_sequence(seq_id, tokens(100 * seq_id, BS + 1))
    events = kv.take_events()
    assert len(events) == 2
    assert kv.stats()["events_dropped"] == 3
    assert kv.take_events() == []


def test_stats_hit_rate_and_evictions() -> None:
    kv = manager(4)
    kv.add_sequence(1, tokens(0, 2 * BS + 1))
    kv.free(1)
    kv.add_sequence(2, tokens(0, 2 * BS + 1))
    stats = kv.stats()
    assert (stats["prefix_query_tokens"], stats["prefix_hit_tokens"]) == (18, 8)
    assert stats["prefix_hit_rate"] == pytest.approx(8 / 18)
    kv.free(2)
    kv.add_sequence(3, tokens(50, 4 * BS))
    assert kv.stats()["evictions"] == 2


def test_truncate_in_the_middle_of_a_chain_loses_no_hit() -> None:
    """Sequence 2 computes P's blocks after the four it shares with sequence 1 and is freed;
    sequence 1 then drops two of the shared blocks; sequence 3 recomputes them. The hit was 5
    tokens where the KV events said 6 were stored (the recomputed block 4 shadowed the cached one
    that block 5 follows); with one indexed copy per content it replaces the cached one."""
    kv = pagedkv.KvCacheManager(
        num_blocks=32, block_size=1, enable_prefix_caching=True, enable_kv_events=True
    )
    p = [1, 2, 3, 4, 5, 6, 7]
    kv.add_sequence(1, p[:4] + [9])
    kv.add_sequence(2, p, num_scheduled=3)
    kv.free(2)
    kv.truncate(1, 2)
    kv.add_sequence(3, p, num_scheduled=3)
    assert kv.match_prefix(p) == 6
    stored: set[int] = set()
    for ev in kv.take_events():
        if isinstance(ev, pagedkv.BlockStored):
            assert not stored & set(ev.block_hashes)
            stored |= set(ev.block_hashes)
        elif isinstance(ev, pagedkv.BlockRemoved):
            stored -= set(ev.block_hashes)
    assert set(kv.prefix_block_hashes(p)[:6]) <= stored
    kv.check_invariants()


def test_cached_block_looks_content_up_by_one_hash() -> None:
    """``cached_block``: the block indexed under one hash (a caller's bytes or pagedkv's own
    int), in use or cached-evictable, chained blocks included; None once evicted or reset;
    wrong arguments are typed errors."""
    kv = pagedkv.KvCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    caller = [bytes([i]) * 32 for i in range(3)]
    kv.add_sequence(1, [1, 2, 3, 4, 5, 6, 7], block_hashes=caller)
    table = kv.block_table(1).tolist()
    # The second and third blocks went in chained (one admission of new content).
    assert [kv.cached_block(h) for h in caller] == table[:3]
    kv.check_invariants()
    kv.free(1)
    assert [kv.cached_block(h) for h in caller] == table[:3]
    own = kv.prefix_block_hashes([9, 9, 8, 8])
    kv.add_sequence(2, [9, 9, 8, 8, 7], num_scheduled=5)
    assert [kv.cached_block(h) for h in own] == kv.block_table(2).tolist()[:2]
    assert kv.cached_block(b"\x05" * 32) is None
    with pytest.raises(pagedkv.InvalidArgumentError):
        kv.cached_block("not a hash")
    with pytest.raises(pagedkv.InvalidArgumentError):
        kv.cached_block(caller[0], group=1)
    kv.free(2)
    assert kv.reset_prefix_cache()
    assert [kv.cached_block(h) for h in caller + own] == [None] * 5
    kv.check_invariants()
