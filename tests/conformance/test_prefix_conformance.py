"""Prefix-cache conformance: the allocator-level behaviours that vLLM v1, TGI v3 and SGLang
assert in their own test suites, re-expressed against pagedkv (facts carried over, not code).

Each test names the upstream test it mirrors. Mapping conventions (docs/conformance.md):

* vLLM reserves block 0 as its null block, so vLLM block ``k`` is pagedkv block ``k - 1``;
  a fresh pagedkv pool hands out blocks in ascending id order, as vLLM's free queue does.
* vLLM keeps cached-but-free blocks in its one free queue; pagedkv keeps them in a separate
  LRU and takes truly free blocks first (docs/conformance.md, "Free blocks before cached
  blocks"). The order *among cached blocks* is the same: sequences in the order they were
  freed, each one's tail block before its head block.
* Eviction order is observed the way vLLM's tests observe it: by the block table of a request
  that misses and must evict everything.
"""

from __future__ import annotations

import pagedkv
import pytest
from conformance_helpers import BS, manager, refcounts, stored, table


def evict_all(kv: pagedkv.KvCacheManager, seq_id: int) -> list[int]:
    """Admits a request that misses and needs every block of the pool; returns the order in
    which it got them (truly free blocks, then the cached ones in eviction order)."""
    kv.add_sequence(seq_id, [7_000_000 + i for i in range(kv.num_blocks * kv.block_size)])
    return table(kv, seq_id)


# --------------------------------------------------------------------------------------------
# Eviction order


def test_lru_eviction_order_after_frees() -> None:
    """A freed sequence's tail block is evicted before its head block, and sequences in the
    order they were freed; a later hit touches (revives) blocks.

    Mirrors vLLM v1 ``tests/v1/core/test_prefix_caching.py::test_evict``: req0 = 5 full blocks
    + 7 tokens, req1 = 3 full blocks, both freed (req0 first): the cached order is
    ``[5, 4, 3, 2, 1, 9, 8, 7]`` (vLLM ids), the never-used and partial blocks ahead of them.
    Then req2 = the first 2 blocks + 3 tokens hits 2 blocks and takes one fresh block.
    """
    kv = manager(10)
    kv.add_sequence(0, list(range(5 * BS + 7)))
    assert table(kv, 0) == [0, 1, 2, 3, 4, 5]
    kv.add_sequence(1, list(range(5 * BS + 7, 5 * BS + 7 + 3 * BS)))
    assert table(kv, 1) == [6, 7, 8]
    assert kv.num_free_blocks == 1
    kv.free(0)
    kv.free(1)
    assert kv.num_free_blocks == 10
    assert kv.stats()["num_cached_blocks"] == 8  # 5 + 3 full blocks; the partial one is free

    # "Touch the first 2 blocks": a hit on cached blocks revives them.
    assert kv.add_sequence(2, list(range(2 * BS + 3))) == 2 * BS
    assert table(kv, 2)[:2] == [0, 1]
    assert table(kv, 2)[2] in (5, 9)  # a truly free block (the partial or the unused one)
    assert kv.num_free_blocks == 7
    kv.free(2)
    kv.check_invariants()

    # vLLM's test_prefill ends the same way: a 10-block miss evicts in the cached order, after
    # the free blocks. Blocks 0, 1 were revived and freed again, so they are the most recent.
    got = evict_all(kv, 3)
    assert sorted(got[:2]) == [5, 9]  # truly free blocks first
    assert got[2:] == [4, 3, 2, 8, 7, 6, 1, 0]
    kv.check_invariants()


def test_freed_tail_before_head_exact_order() -> None:
    """The exact eviction order of a freed chain: tail first, and an earlier-freed request's
    blocks before a later-freed one's.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_prefill`` (free queue after freeing req0
    and req1: ``[..., 3, 2, 1]``, and a 10-block miss gets the blocks in exactly that order) and
    TGI v3 ``backends/v3/src/radix.rs::allocator_collects_older_prefixes_first`` (the prefix
    freed first is collected first).
    """
    kv = manager(7, block_size=1)
    kv.add_sequence(1, [0, 1, 2, 3])  # 4 full one-token blocks
    kv.add_sequence(2, [4, 5])
    assert table(kv, 1) == [0, 1, 2, 3]
    assert table(kv, 2) == [4, 5]
    kv.free(1)
    kv.free(2)
    # Block 6 is truly free; then request 1's blocks tail first, then request 2's.
    kv.add_sequence(3, [100 + i for i in range(7)])
    assert table(kv, 3) == [6, 3, 2, 1, 0, 5, 4]
    kv.check_invariants()


# --------------------------------------------------------------------------------------------
# Hits


def test_hit_on_blocks_still_in_use_shares_them() -> None:
    """A prefix hit on blocks another running request holds shares them (refcount 2); the
    new request allocates only its own tail; after both free, every block is available.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_prefill`` (req1 hits blocks 1, 2, 3 of the
    still-running req0, ``ref_cnt == 2``, 5 free blocks left, all 10 free after both free) and
    TGI v3 ``radix.rs::allocator_reuses_prefixes``.
    """
    kv = manager(10)
    common = [i for i in range(3) for _ in range(BS)]
    assert kv.add_sequence(0, common + [3] * 7) == 0
    assert table(kv, 0) == [0, 1, 2, 3]
    assert kv.add_sequence(1, common + [3] * 5) == 3 * BS
    assert table(kv, 1) == [0, 1, 2, 4]
    assert [kv.refcount(b) for b in (0, 1, 2)] == [2, 2, 2]
    assert kv.refcount(3) == kv.refcount(4) == 1
    assert kv.num_free_blocks == 5
    kv.free(0)
    kv.free(1)
    assert kv.num_free_blocks == 10
    # Hit again once the blocks are cached-free (lazy eviction); the partial block is reused.
    assert kv.add_sequence(2, common + [3] * 6) == 3 * BS
    assert table(kv, 2)[:3] == [0, 1, 2]
    assert kv.num_free_blocks == 6
    kv.check_invariants()


def test_no_hash_before_a_block_is_full_then_hittable() -> None:
    """A partly filled block is never hit; once decode fills it, it is hittable, chained to
    the blocks before it.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_decode`` / ``test_cache_blocks`` (only full
    blocks get a hash; the block hash appears when appended tokens complete the block).
    """
    kv = manager(16)
    prompt = list(range(BS + 7))
    kv.add_sequence(0, prompt)
    assert kv.add_sequence(1, prompt + [99] * 9) == BS  # block 2 of seq 0 is partial: no hit
    kv.free(1)
    kv.append_tokens(0, [50 + i for i in range(9)])  # seq 0 fills its second block
    filled = prompt + [50 + i for i in range(9)]
    assert kv.add_sequence(2, filled + [1]) == 2 * BS
    assert table(kv, 2)[:2] == table(kv, 0)[:2]
    # A different first block breaks the chain even with the same second block.
    assert kv.add_sequence(3, [1] + filled[1:] + [1]) == 0
    kv.check_invariants()


def test_the_last_token_is_never_served_and_matches_are_block_aligned() -> None:
    """Matched lengths are whole blocks (page-aligned) and at most ``len - 1`` tokens: the last
    prompt token is always recomputed.

    Mirrors SGLang ``test/srt/test_radix_cache_unit.py`` (``match_prefix`` with ``page_size >
    1`` returns a page-aligned length), vLLM v1 ``test_prefix_caching.py::test_prefill`` (hit
    lengths in whole blocks; a full-prompt hit is capped one token short) and TGI v3
    ``radix.rs::trie_insertions_have_correct_prefix_len``.
    """
    bs = 4
    kv = manager(64, block_size=bs)
    base = list(range(40))
    kv.add_sequence(0, base)
    for n in range(1, 41):
        for extra in (0, 1):
            prompt = base[:n] + [1000] * extra
            hit = kv.add_sequence(1, prompt)
            assert hit % bs == 0
            assert hit == min(n, len(prompt) - 1) // bs * bs
            kv.free(1)
    kv.check_invariants()


def test_caching_disabled_gives_no_hits() -> None:
    """With prefix caching off, identical prompts never share blocks.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_basic_prefix_caching_disabled``.
    """
    kv = manager(16, enable_prefix_caching=False)
    prompt = list(range(3 * BS))
    assert kv.add_sequence(0, prompt) == 0
    assert kv.add_sequence(1, prompt) == 0
    assert not set(table(kv, 0)) & set(table(kv, 1))
    kv.free(0)
    assert kv.add_sequence(2, prompt) == 0
    assert kv.take_events() == []
    kv.check_invariants()


def test_salt_isolates_namespaces() -> None:
    """The same tokens under different cache salts (or LoRA / extra keys) never hit each
    other; the same salt hits.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_cache_key_salting`` and the LoRA / multimodal
    extra-key cases of ``test_kv_cache_utils.py::test_generate_block_hash_extra_keys``.
    """
    kv = manager(32)
    prompt = list(range(3 * BS + 1))
    assert kv.add_sequence(0, prompt, extra_key="salt1") == 0
    assert kv.add_sequence(1, prompt, extra_key="salt2") == 0
    assert kv.add_sequence(2, prompt) == 0
    assert kv.add_sequence(3, prompt, extra_key="salt1") == 3 * BS
    assert table(kv, 3)[:3] == table(kv, 0)[:3]
    assert kv.add_sequence(4, prompt, extra_key="salt2") == 3 * BS
    assert table(kv, 4)[:3] == table(kv, 1)[:3]
    kv.check_invariants()


# --------------------------------------------------------------------------------------------
# Reuse, eviction and failure


def test_a_reused_block_loses_its_old_hash() -> None:
    """When a cached block is reallocated for new content, its old hash is gone: the old
    prompt no longer hits it.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_hash_block_correct_reuse``.
    """
    kv = manager(2)
    prompt = list(range(BS))
    kv.add_sequence(0, prompt)
    kv.free(0)
    assert kv.stats()["num_cached_blocks"] == 1
    kv.add_sequence(1, [500 + i for i in range(2 * BS)])  # the free block, then evicts block 0
    assert table(kv, 1) == [1, 0]
    kv.free(1)
    assert kv.add_sequence(2, prompt + [1]) == 0
    kv.check_invariants()


def test_own_hits_are_never_evicted_for_own_new_blocks() -> None:
    """A request's cached prefix hits are pinned before its new blocks are taken: even when
    the hit block is first in eviction order, another cached block is evicted instead.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_computed_blocks_not_evicted``.
    """
    kv = manager(2)
    kv.add_sequence(0, list(range(BS)))
    kv.add_sequence(1, list(range(BS, 2 * BS)))
    assert (table(kv, 0), table(kv, 1)) == ([0], [1])
    kv.free(0)
    kv.free(1)  # cached order: block 0 (least recent), then block 1
    assert kv.add_sequence(2, list(range(BS)) + [900] * BS) == BS
    assert table(kv, 2) == [0, 1]  # hit block 0 kept; block 1 evicted for the new content
    kv.check_invariants()


def test_failed_admission_changes_nothing() -> None:
    """An admission that cannot get enough blocks changes no refcount, no index entry and no
    eviction order; the same request fits once blocks are freed.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_prefill_not_enough_free_blocks_with_computed_blocks``
    (``allocate_slots`` returns None and the hit blocks' refcounts and the free queue are
    unchanged).
    """
    kv = manager(12)
    common = [i for i in range(3) for _ in range(BS)]
    kv.add_sequence(0, common + [3] * 7)  # 4 blocks: 0..3
    kv.add_sequence(1, [200 + i for i in range(2 * BS)])  # 2 blocks: 4, 5
    kv.free(1)  # cached: 5, 4; truly free: 6..11
    before = (refcounts(kv), kv.num_free_blocks, kv.stats()["num_cached_blocks"])
    with pytest.raises(pagedkv.OutOfBlocksError):
        kv.add_sequence(2, common + [400 + i for i in range(9 * BS)])  # 3 hits + 9 new > 6 + 2
    assert (refcounts(kv), kv.num_free_blocks, kv.stats()["num_cached_blocks"]) == before
    assert 2 not in kv
    kv.check_invariants()
    # The index and the eviction order are unchanged too: seq 1's prompt still hits, and a
    # miss takes the free blocks, then 5 before 4.
    assert kv.add_sequence(3, [200 + i for i in range(2 * BS)] + [1]) == 2 * BS
    kv.free(3)
    kv.free(0)
    assert kv.add_sequence(4, common + [400 + i for i in range(7 * BS)]) == 3 * BS
    kv.check_invariants()


def test_reset_refused_while_blocks_are_in_use() -> None:
    """``reset_prefix_cache`` refuses (False, nothing changed) while any block is in use;
    afterwards it clears every hash, so nothing hits.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_reset_prefix_cache``.
    """
    kv = manager(16, enable_kv_events=True)
    prompt = list(range(2 * BS + 1))
    kv.add_sequence(0, prompt)
    kv.take_events()
    assert kv.reset_prefix_cache() is False
    assert kv.take_events() == []
    assert kv.stats()["num_blocks_in_use"] == 3
    kv.free(0)
    assert kv.reset_prefix_cache() is True
    assert kv.stats()["num_cached_blocks"] == 0
    assert isinstance(kv.take_events()[-1], pagedkv.AllBlocksCleared)
    assert kv.add_sequence(1, prompt) == 0
    kv.check_invariants()


def test_same_content_on_two_physical_blocks() -> None:
    """The same content computed on two physical blocks is indexed once: the copy in use when the
    second is computed keeps it, the second stays private (no event), a cached copy is replaced
    by the one computing it (no event either), and every content is reported stored once.

    vLLM v1 keeps several blocks per hash instead (``test_prefix_caching.py::
    test_block_lookup_cache_multi_blocks_per_key``) and reports each copy
    (``test_kv_cache_events``); pagedkv keeps one so that a hit is never shorter than what its
    events say is stored (docs/conformance.md, "Duplicate copies").
    """
    kv = manager(7, enable_kv_events=True)
    prompt = list(range(2 * BS))
    kv.add_sequence(0, prompt)  # blocks 0, 1
    # The same 2 blocks: the whole prompt is never served, so block 2 computes block 1's
    # content again while block 1 is in use: it stays private.
    assert kv.add_sequence(1, prompt) == BS
    assert table(kv, 1) == [0, 2]
    hashes = [h for e in stored(kv.take_events()) for h in e.block_hashes]
    assert len(hashes) == 2  # each content reported once
    kv.free(1)  # the private copy goes back to the free list; block 0 still used by seq 0
    assert kv.stats()["num_cached_blocks"] == 0
    kv.free(0)  # blocks 0 and 1 cached
    # A third computation while block 1 is cached replaces it (no event): block 1 is freed.
    assert kv.add_sequence(2, prompt) == BS
    assert table(kv, 2) == [0, 2]
    assert kv.take_events() == []
    assert kv.stats()["num_cached_blocks"] == 0
    assert kv.num_free_list_blocks == 5  # blocks 1 and 3..6
    kv.free(2)
    assert kv.add_sequence(3, prompt + [5]) == 2 * BS  # the copy that replaced block 1
    assert table(kv, 3)[:2] == [0, 2]
    kv.check_invariants()


# --------------------------------------------------------------------------------------------
# KV events


def test_events_contract() -> None:
    """One ``BlockStored`` per caching call with the chained parent hash, the hashes in chain
    order and the blocks' tokens; ``BlockRemoved`` only when a cached block is reallocated
    (never on free); ``AllBlocksCleared`` on reset.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_kv_cache_events`` (and the events contract
    of ``vllm/distributed/kv_events.py``: ``block_hashes``, ``parent_block_hash``,
    ``token_ids``, ``block_size``, ``medium``).
    """
    kv = manager(4, enable_kv_events=True)
    prompt = list(range(2 * BS + 3))
    kv.add_sequence(0, prompt)
    events = kv.take_events()
    assert len(events) == 1
    (first,) = stored(events)
    assert first.parent_block_hash is None
    assert len(first.block_hashes) == 2
    assert list(first.token_ids) == prompt[: 2 * BS]
    assert first.block_size == BS
    # Decode fills block 3: one more event, chained to the last stored hash.
    kv.append_tokens(0, [70 + i for i in range(BS - 3)])
    (second,) = stored(kv.take_events())
    assert second.parent_block_hash == first.block_hashes[-1]
    assert list(second.token_ids) == prompt[2 * BS :] + [70 + i for i in range(BS - 3)]
    # Free: no event (the blocks stay cached).
    kv.free(0)
    assert kv.take_events() == []
    # A miss needing all 4 blocks evicts the 3 cached ones: one BlockRemoved per block, in
    # eviction order (tail first), then one BlockStored for the new blocks.
    kv.add_sequence(1, [900 + i for i in range(4 * BS)])
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, pagedkv.BlockRemoved)]
    assert [list(e.block_hashes) for e in removed] == [
        [second.block_hashes[0]],
        [first.block_hashes[1]],
        [first.block_hashes[0]],
    ]
    assert isinstance(events[-1], pagedkv.BlockStored)
    assert events.index(removed[-1]) < len(events) - 1
    kv.free(1)
    assert kv.reset_prefix_cache()
    assert isinstance(kv.take_events()[-1], pagedkv.AllBlocksCleared)


def test_events_off_by_default() -> None:
    """KV events are opt-in (``enable_kv_events``, default off, as vLLM's
    ``enable_kv_cache_events``): without it nothing is recorded and nothing is dropped.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_kv_cache_events`` (events only with
    ``enable_kv_cache_events=True``).
    """
    kv = manager(4)
    kv.add_sequence(0, list(range(2 * BS + 3)))
    kv.free(0)
    kv.add_sequence(1, [900 + i for i in range(4 * BS)])
    kv.free(1)
    assert kv.reset_prefix_cache()
    assert kv.take_events() == []
    assert kv.stats()["events_dropped"] == 0


def test_partially_overlapping_prefills_free_fully() -> None:
    """Two prompts sharing a prefix, freed in either order, leave every block reclaimable, and
    re-admitting each hits its whole cached chain.

    Mirrors TGI v3 ``radix.rs::allocator_frees_partially_overlapping_prefills`` and
    ``allocator_frees_fully_overlapping_prefills``.
    """
    bs = 2
    kv = manager(19, block_size=bs)
    a = [0, 1, 2, 3, 4, 5]
    b = [0, 1, 2, 3, 6, 7]
    kv.add_sequence(1, [0, 1])
    kv.free(1)
    assert kv.add_sequence(2, a + [10, 11]) == 2
    assert kv.add_sequence(3, b + [12, 13]) == 4
    kv.free(3)
    kv.free(2)
    assert kv.num_free_blocks == 19
    assert kv.add_sequence(4, a) == 4  # capped one token short: 2 of 3 blocks
    assert kv.add_sequence(5, a + [10, 11, 9]) == 8
    kv.free(4)
    kv.free(5)
    assert kv.num_free_blocks == 19
    kv.check_invariants()
