"""Sharing conformance: cached blocks held by live requests are protected from eviction, and
live requests with the same prompt release everything when they finish, in any order, as
SGLang and TGI v3 assert in their allocator tests (facts carried over, not code).
Conventions and deliberate differences: docs/conformance.md.
"""

from __future__ import annotations

import pagedkv
import pytest
from conformance_helpers import manager, refcounts, table


def test_a_live_hit_moves_blocks_from_evictable_to_protected() -> None:
    """A live request that hits cached blocks takes them out of the evictable set (they count
    as in use) and its free puts them back; while it runs, nothing can evict them.

    Mirrors SGLang ``test/srt/test_radix_cache_unit.py::TestRadixCache::test_lock_ref_operations``:
    locking the node of a 3-token match lowers ``evictable_size`` and raises ``protected_size`` by
    3, and unlocking restores both. pagedkv's lock is the hitting sequence itself (refcount).
    """
    bs = 2
    kv = manager(8, block_size=bs)
    prompt = [1, 2, 3, 4, 5, 6]
    kv.add_sequence(0, prompt)
    kv.free(0)
    before = kv.stats()
    assert (before["num_cached_blocks"], before["num_blocks_in_use"]) == (3, 0)

    assert kv.add_sequence(1, prompt + [7]) == 3 * bs  # 3 hits + 1 own partial block
    locked = kv.stats()
    assert locked["num_cached_blocks"] == before["num_cached_blocks"] - 3
    assert locked["num_blocks_in_use"] == before["num_blocks_in_use"] + 3 + 1
    assert refcounts(kv)[:3] == [1, 1, 1]
    # Only the 4 truly free blocks are allocatable: a miss needing 5 fails rather than evict.
    assert kv.num_free_blocks == 4
    with pytest.raises(pagedkv.OutOfBlocksError):
        kv.add_sequence(2, num_tokens=5 * bs)
    assert table(kv, 1)[:3] == [0, 1, 2]

    kv.free(1)
    after = kv.stats()
    assert (after["num_cached_blocks"], after["num_blocks_in_use"]) == (3, 0)
    kv.check_invariants()


def test_fully_overlapping_live_prompts_free_in_reverse_order() -> None:
    """Two live requests with the same prompt, freed in the reverse order, leave every block
    allocatable, and a third request with that prompt hits all of it.

    Mirrors TGI v3 ``backends/v3/src/radix.rs::allocator_frees_fully_overlapping_prefills``
    (two allocations of ``[0, 1, 2, 3]`` with block size 1, freed second-first; a third hits the
    whole prefix, ``prefix_len == 4``, and all other blocks are free). pagedkv shares the
    running request's blocks (refcount 2, as vLLM's ``test_prefill``); the second request
    computes its last block again, and, as TGI does, that duplicate goes back to the free list
    (one indexed copy per content: docs/conformance.md, "Duplicate copies").
    """
    kv = manager(10, block_size=1)
    prompt = [0, 1, 2, 3]
    assert kv.add_sequence(1, prompt) == 0
    assert kv.add_sequence(2, prompt) == 3  # the last prompt token is always recomputed
    assert table(kv, 1) == [0, 1, 2, 3]
    assert table(kv, 2) == [0, 1, 2, 4]
    assert refcounts(kv)[:5] == [2, 2, 2, 1, 1]

    kv.free(2)
    kv.free(1)
    assert kv.num_free_blocks == 10
    assert kv.stats()["num_cached_blocks"] == 4  # one copy of each block

    assert kv.add_sequence(3, prompt + [9]) == 4  # the whole prefix
    assert table(kv, 3)[:4] == [0, 1, 2, 3]
    assert kv.num_free_blocks == 5  # every block this request does not hold
    assert kv.stats()["num_cached_blocks"] == 0
    kv.check_invariants()
