"""Hybrid KV groups (full attention + sliding windows on one pool) against vLLM v1's hybrid tests.

Each test names the upstream test it mirrors and uses its parameters; expected values are the
upstream ones where pagedkv's observable differs only in block ids (vLLM's block 0 is its null
block, pagedkv marks a released position with -1):

- ``tests/v1/core/test_prefix_caching.py::test_prefill_hybrid_model``: block 16, one full
  group and two window groups of 2 blocks (32 tokens), 20 usable blocks;
- ``tests/v1/core/test_single_type_kv_cache_manager.py::test_sliding_window_possible_cached_prefix``:
  block 2, window 4: which cached-block patterns give which hit;
- ``...::test_sliding_window_remove_skipped_blocks``: block 2, window 4: which leading blocks
  are released at 0, 4, 5, 6, 7 and 11 computed tokens, and their eviction order.

vLLM removes cache entries by hand to shape the cache (``cached_block_hash_to_block.pop``);
pagedkv has no such door, so these tests shape it through eviction: a second manager on the
same ``BlockPool`` reclaims exactly ``k`` of the hybrid manager's least recently used cached
blocks, the blocks it takes say which ones went, and the hit must then be the longest prefix
every group can still serve (vLLM's rule, ``_window_hit`` / ``_hybrid_hit`` below, each checked
against vLLM's own cases first).
"""

from __future__ import annotations

import random

import pagedkv
import pytest

FULL = None


def _manager(num_blocks: int, block_size: int, windows: list[int | None]) -> pagedkv.KvCacheManager:
    groups = [pagedkv.FullAttention() if w is None else pagedkv.SlidingWindow(window=w) for w in windows]
    pool = pagedkv.BlockPool(num_blocks=num_blocks, block_size=block_size)
    return pagedkv.KvCacheManager(pool=pool, enable_prefix_caching=True, kv_groups=groups)


def _tables(kv: pagedkv.KvCacheManager, seq_id: int, num_groups: int) -> list[list[int]]:
    return [kv.block_table(seq_id, group=g).tolist() for g in range(num_groups)]


def _evict(kv: pagedkv.KvCacheManager, count: int) -> list[int]:
    """Evicts exactly ``count`` of ``kv``'s cached blocks, least recently used first, and
    returns them in eviction order: a second manager on the same pool takes every free block,
    then one block at a time, which it can only reclaim from ``kv``'s cache."""
    pool = kv.pool
    peer = pagedkv.KvCacheManager(pool=pool)
    if pool.num_free_blocks:
        peer.add_sequence(0, num_tokens=pool.num_free_blocks * pool.block_size)
    evicted = []
    for seq_id in range(1, count + 1):
        peer.add_sequence(seq_id, num_tokens=pool.block_size)
        evicted.append(int(peer.block_table(seq_id)[0]))
    return evicted


def _contiguous_for_hit(window: int, block_size: int) -> int:
    """Blocks a window group needs cached just before a hit: those covering the ``window - 1``
    keys before the hit point (vLLM's ``_contiguous_blocks_for_hit`` without EAGLE)."""
    return -(-(window - 1) // block_size)


def _window_hit(cached: list[bool], need: int) -> int:
    """vLLM's ``SlidingWindowManager.find_longest_cache_hit`` in blocks: the rightmost run of
    ``need`` cached blocks ends the hit; a shorter run reaching block 0 also counts. A hit ends
    only at a cached block, even with ``need`` 0 (a window of one token)."""
    run = 0
    for i in range(len(cached) - 1, -1, -1):
        if not cached[i]:
            run = 0
            continue
        run += 1
        if run >= need:
            return i + run
    return run


def _hybrid_hit(cached: list[list[bool]], windows: list[int | None], block_size: int) -> int:
    """The longest prefix (in blocks) every group can serve: the full groups' cached prefix,
    then each window group's hit below it, to a fixed point (vLLM's hybrid coordinator)."""
    hit = len(cached[0])
    for g, w in enumerate(windows):
        if w is None:
            hit = next((i for i in range(hit) if not cached[g][i]), hit)
    while True:
        before = hit
        for g, w in enumerate(windows):
            if w is not None:
                hit = _window_hit(cached[g][:hit], _contiguous_for_hit(w, block_size))
        if hit == before:
            return hit


def test_reference_rules_reproduce_vllms_cases() -> None:
    """The two helpers above give vLLM's expected values on vLLM's own cases."""
    t, f = True, False
    need = _contiguous_for_hit(4, 2)
    cases = [
        ([f] * 10, 0),
        ([t], 1),
        ([t, f], 1),
        ([t, t], 2),
        ([t, t, f], 2),
        ([t, t, t], 3),
        ([t, t, t, f], 3),
        ([t, t, f, t, f, f, t, t, f, t, t, t], 12),
        ([t, t, f, t, f, f, t, t, f, f, f], 8),
        ([t, t, f, t, f, f, t, t, f, f, f, t], 8),
    ]
    for cached, expected in cases:
        assert _window_hit(cached, need) == expected, cached
    # test_prefill_hybrid_model: which (group, block) entries are gone -> hit in blocks
    windows = [FULL, 32, 32]
    hybrid_cases = [
        ([(1, 0), (2, 0)], 3),
        ([(0, 0)], 0),
        ([(0, 2), (1, 2), (2, 2)], 2),
        ([(0, 2)], 2),
        ([(1, 2)], 2),
        ([(2, 2)], 2),
        ([(0, 2), (1, 0), (2, 0)], 0),
    ]
    for missing, expected in hybrid_cases:
        cached = [[(g, i) not in missing for i in range(3)] for g in range(3)]
        assert _hybrid_hit(cached, windows, 16) == expected, missing


def _prefill_hybrid_model() -> tuple[pagedkv.KvCacheManager, list[int], list[list[int]]]:
    """The first half of vLLM's test_prefill_hybrid_model; returns the manager, the second
    prompt and the tables of its three cached blocks (both requests freed)."""
    kv = _manager(20, 16, [FULL, 32, 32])
    common = [i for i in range(3) for _ in range(16)]
    first = common + [3] * 7
    assert kv.match_prefix(first) == 0
    assert kv.add_sequence(0, first) == 0
    t0 = _tables(kv, 0, 3)
    # 4 blocks per group, distinct over the groups; the admission pass starts at 0, so no
    # window position is released yet (vLLM: ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]))
    assert [len(t) for t in t0] == [4, 4, 4]
    assert len({b for t in t0 for b in t}) == 12 and min(b for t in t0 for b in t) >= 0
    assert kv.stats()["num_blocks_in_use"] == 12
    second = common + [3] * 5
    assert kv.match_prefix(second) == 48
    assert kv.add_sequence(1, second) == 48
    t1 = _tables(kv, 1, 3)
    # vLLM's hit blocks ([1, 2, 3], [0, 6, 7], [0, 10, 11]): the window groups need only the
    # 2 blocks before the hit point, block 0 is not taken (null); then one new block per group
    assert t1[0][:3] == t0[0][:3]
    assert t1[1][:3] == [-1] + t0[1][1:3]
    assert t1[2][:3] == [-1] + t0[2][1:3]
    new = [t[3] for t in t1]
    assert len(set(new)) == 3 and not set(new) & {b for t in t0 for b in t}
    for g in range(3):
        for b in t1[g][:3]:
            if b >= 0:
                assert kv.refcount(b) == 2
    assert kv.refcount(t0[1][0]) == kv.refcount(t0[2][0]) == 1
    assert kv.stats()["num_blocks_in_use"] == 15  # vLLM: 5 of 20 free
    kv.check_invariants()
    cached_tables = [t[:3] for t in t0]
    return kv, second, cached_tables


def test_prefill_hybrid_model_hits() -> None:
    kv, second, _ = _prefill_hybrid_model()
    kv.free(0)
    kv.free(1)
    assert kv.stats()["num_blocks_in_use"] == 0
    # every group still has all three blocks: the whole common prefix hits again
    assert kv.match_prefix(second) == 48
    kv.check_invariants()


@pytest.mark.parametrize("free_order", [(0, 1), (1, 0)])
def test_prefill_hybrid_model_partial_hits_after_eviction(free_order: tuple[int, int]) -> None:
    """vLLM's partial-hit cases, reached by eviction: for every number of evicted cached
    blocks, the hit is the longest prefix every group can still serve."""
    seen = set()
    for count in range(10):
        kv, second, cached_tables = _prefill_hybrid_model()
        for seq_id in free_order:
            kv.free(seq_id)
        evicted = set(_evict(kv, count))
        cached = [[b not in evicted for b in t] for t in cached_tables]
        expected = _hybrid_hit(cached, [FULL, 32, 32], 16) * 16
        assert kv.match_prefix(second) == expected, (count, cached)
        assert kv.add_sequence(9, second) == expected
        kv.check_invariants()
        seen.add(expected)
    assert len(seen) >= 2  # the sweep passes through different hits, down to a miss
    assert 0 in seen


def test_sliding_window_possible_cached_prefix() -> None:
    """Block 2, window 4: cached-block patterns with gaps, made by touching pairs of blocks
    through hits and then evicting the least recently used, give vLLM's window hit."""
    windows = [FULL, 4]
    prompt = list(range(23))  # 11 full blocks of 2 and one token
    reached = set()
    for seed in range(12):
        rng = random.Random(seed)
        kv = _manager(64, 2, windows)
        kv.add_sequence(0, prompt)
        full_blocks = [_tables(kv, 0, 2)[g][:11] for g in range(2)]
        kv.free(0)
        for n, i in enumerate(rng.sample(range(2, 12), 4)):
            # a hit at 2 * i tokens touches the window's 2 blocks before it (and the full
            # group's whole prefix): they become the most recently used
            kv.add_sequence(100 + n, prompt[: 2 * i + 1])
            kv.free(100 + n)
        evicted = set(_evict(kv, rng.randrange(1, 18)))
        cached = [[b not in evicted for b in t] for t in full_blocks]
        expected = _hybrid_hit(cached, windows, 2) * 2
        assert kv.match_prefix(prompt) == expected, (seed, cached)
        kv.check_invariants()
        reached.add(tuple(cached[1]))
    # patterns with gaps in the window group were reached, not only cached prefixes
    assert any(any(not a and b for a, b in zip(p, p[1:], strict=False)) for p in reached)


def test_sliding_window_remove_skipped_blocks() -> None:
    """Block 2, window 4: a pass starting at 0, 4, 5, 6, 7 and 11 computed tokens releases the
    leading 0, 0, 1, 1, 2 and 4 blocks (vLLM's remove_skipped_blocks at those counts); the
    released blocks are evicted in release order, a later block before an earlier one when
    one pass releases both (vLLM: block 3 before block 2)."""
    kv = _manager(40, 2, [FULL, 4])
    tokens = list(range(22))
    kv.add_sequence(1, tokens, num_scheduled=4)  # the pass from 0 computes 4 tokens
    original = _tables(kv, 1, 2)[1]
    assert -1 not in original

    def released() -> int:
        table = _tables(kv, 1, 2)
        assert -1 not in table[0]
        return sum(b < 0 for b in table[1])

    assert released() == 0
    for count, expected in [(1, 0), (1, 1), (1, 1), (4, 2), (1, 4)]:
        kv.advance_computed([1], count)  # a pass starting at 4, 5, 6, 7, 11
        assert released() == expected
        assert _tables(kv, 1, 2)[1][expected:] == original[expected:]
        kv.check_invariants()
    assert _evict(kv, 4) == [original[0], original[1], original[3], original[2]]


def _cached_after_duplicate_prefill(kv: pagedkv.KvCacheManager) -> int:
    """Two requests compute the same 9-token prompt independently (neither can hit the other:
    both are admitted before either pass), then both are freed; returns the cached blocks."""
    prompt = list(range(9))  # 2 full blocks of 4 and one token
    kv.add_sequence(1, prompt, num_scheduled=0)
    kv.add_sequence(2, prompt, num_scheduled=0)
    kv.advance_computed([1, 2], 9)
    kv.free(1)
    kv.free(2)
    kv.check_invariants()
    return int(kv.stats()["num_cached_blocks"])


def test_duplicate_content_is_cached_once_single_group() -> None:
    """vLLM's BlockHashToBlockMap keeps every copy of a content (``tests/v1/core/
    test_prefix_caching.py::test_block_lookup_cache_multi_blocks_per_key``): 2 requests x 2
    full blocks stay cached. The single-group manager keeps one copy per content (the one in use
    when the second was computed: docs/conformance.md, "Duplicate copies"), so 2 stay cached and
    the duplicates go back to the free list, as TGI's radix allocator does."""
    kv = pagedkv.KvCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    assert _cached_after_duplicate_prefill(kv) == 2
    assert kv.num_free_list_blocks == 30


def test_duplicate_content_is_cached_once_per_group_hybrid() -> None:
    """The same with a full-attention group and a window group: vLLM 0.33's hybrid manager
    holds 2 requests x 2 groups x 2 full blocks = 8 cached blocks (measured in the peer venv);
    pagedkv's one manager keeps one copy per content in every group, as with a single group
    (docs/conformance.md, "Duplicate copies"): 2 groups x 2 blocks = 4, the duplicates back on
    the free list."""
    kv = _manager(32, 4, [FULL, 8])
    assert _cached_after_duplicate_prefill(kv) == 4
    assert kv.num_free_list_blocks == 28


@pytest.mark.parametrize("windows", [[1], [1, 1], [FULL, 1], [FULL, 4, 1]])
def test_one_token_window_caches_nothing_and_serves_no_hit(windows: list[int | None]) -> None:
    """A window of one token needs no cached block before a hit (``cdiv(W - 1, B)`` is 0), but
    vLLM 0.33 caches none of its blocks (``SlidingWindowManager.reachable_block_mask`` keeps
    the ``need`` blocks that end a hit's window: none) and its scan finds a hit only at a
    cached block, so such a group serves 0 and so does the hybrid manager, however much the
    other groups cache. Fails on the rule that served any prefix through such a window."""
    kv = _manager(64, 4, windows)
    prompt = list(range(13))  # 3 full blocks of 4 and one token
    assert kv.add_sequence(1, prompt) == 0
    kv.free(1)
    kv.check_invariants()
    # only the groups other than the one-token windows cache their 3 full blocks
    assert kv.stats()["num_cached_blocks"] == 3 * sum(w != 1 for w in windows)
    assert kv.match_prefix(prompt) == 0
    assert kv.add_sequence(2, prompt) == 0
    kv.check_invariants()
    assert _window_hit([True, True, False], 0) == 2
    assert _window_hit([False, False], 0) == 0
