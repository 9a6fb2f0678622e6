"""Where vLLM's duplicate copies start to change its answers (benches/vllm_scheduler.py's ``run``,
vLLM's own manager only): a shadow of pagedkv's prefix index kept from vLLM's block pool, for the
second way they do (docs/conformance.md, Duplicate copies).

vLLM indexes every copy of a content; pagedkv indexes one (the first, unless that one was cached-
evictable when the second was computed: then the second, the first going to the free list), and
the other copies, once their requests free them, go to pagedkv's free list, not to its LRU of
cached blocks. vLLM frees every copy to the back of one free queue (cached blocks) and hands out
unindexed blocks first, as pagedkv does. So while vLLM's queue holds such a *spare* copy, pagedkv
has a free-list block more than vLLM has unindexed ones, and where vLLM's allocation evicts a
content from the front of its queue, pagedkv's takes that free block and keeps the content
cached. A later look-up reaching that content hits further on pagedkv's manager than on vLLM's;
one side then admits, preempts or loads what the other does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_scheduler_trace import Trace


class PagedkvShadow:
    """pagedkv's prefix index, followed from vLLM's (blocks are vLLM's; keys are vLLM's
    (block hash, group) keys):

    - ``indexed``: per key, the vLLM block whose counterpart pagedkv indexes;
    - ``kept``: keys pagedkv still caches that vLLM evicted, oldest first (at pagedkv's LRU
      front: they were at vLLM's queue front when vLLM evicted them);
    - ``lost``: keys vLLM indexes through copies only, pagedkv's own copy evicted.
    pagedkv's free list holds, beyond vLLM's unindexed free blocks, one block per spare copy
    (a refcount-0 vLLM copy that is not ``indexed``), less one per ``kept`` key."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.index: dict[Any, Any] = pool.cached_block_hash_to_block._cache
        self.indexed: dict[Any, Any] = {}
        self.kept: list[Any] = []
        self.lost: set[Any] = set()

    def _is_indexed(self, key: Any, block: Any) -> bool:
        return self.indexed.get(key) is block and block.block_hash == key

    def spare_copies(self) -> int:
        """vLLM's cached-evictable copies that pagedkv holds on its free list instead."""
        spare = 0
        for key, copies in self.index.items():
            if type(copies) is dict:
                spare += sum(b.ref_cnt == 0 and not self._is_indexed(key, b) for b in copies.values())
        return spare

    def free_list_blocks(self) -> int:
        """pagedkv's free-list blocks now (the core's ``num_free_list_blocks``): vLLM's free
        blocks without a hash, one per spare copy, less one per kept content."""
        unindexed = sum(b.block_hash is None for b in self.pool.free_block_queue.get_all_free_blocks())
        return unindexed + self.spare_copies() - len(self.kept)

    def inserted(self, key: Any, block: Any) -> None:
        """vLLM indexed `block` under `key`: pagedkv indexes the block computing it unless its
        indexed copy is held (a cached-evictable one goes to the free list, as does a kept one)."""
        current = self.indexed.get(key)
        if current is None or current.block_hash != key or current.ref_cnt == 0:
            self.indexed[key] = block
            self.lost.discard(key)
            if key in self.kept:
                self.kept.remove(key)

    def evicting(self, block: Any) -> None:
        """vLLM's allocation is about to evict `block` (refcount 0, indexed): what pagedkv's
        allocation does at the same point. It takes a free-list block while it has more than
        vLLM (a spare copy not yet spent on a kept content), else it evicts its LRU front, its
        oldest kept content (or, with none kept, what vLLM evicts)."""
        key = block.block_hash
        takes_free = self.spare_copies() > len(self.kept)
        evicts_kept = not takes_free and bool(self.kept)
        if evicts_kept:
            evicted = self.kept.pop(0)
            if evicted in self.index:
                # vLLM had evicted one copy of this content and still indexes another: pagedkv's
                # one copy goes now, vLLM's other stays.
                self.lost.add(evicted)
        if self._is_indexed(key, block):
            del self.indexed[key]
            if takes_free or evicts_kept:
                self.kept.append(key)  # pagedkv keeps the content vLLM evicts
            elif type(self.index.get(key)) is dict:
                self.lost.add(key)  # pagedkv evicts it too; vLLM still holds another copy

    def differences(self) -> tuple[list[Any], list[Any]]:
        """(keys pagedkv caches and vLLM does not, keys vLLM caches and pagedkv does not)."""
        return [k for k in self.kept if k not in self.index], [k for k in self.lost if k in self.index]


def _hit_with(manager: Any, shadow: PagedkvShadow, block_hashes: list[Any], limit: int) -> tuple[int, int]:
    """vLLM's look-up of `block_hashes` (at most `limit` tokens) on `shadow`'s index: pagedkv's
    hit and shared-prefix boundary (``get_computed_blocks``' second and third answers: the
    boundary is the longest single group's hit where it passes the hit, else 0). vLLM's index is
    changed for the look-up (stand-in blocks for the contents only pagedkv caches, the contents
    only vLLM caches taken out) and restored."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    index = shadow.index
    absent, extra = shadow.differences()
    saved = {key: index.pop(key) for key in extra}
    for n, key in enumerate(absent):
        index[key] = KVCacheBlock(block_id=-1 - n)  # a stand-in, never handed out
    try:
        _, hit, uncached = manager.coordinator.find_longest_cache_hit(block_hashes, limit)
        return int(hit), int(hit + uncached if uncached else 0)
    finally:
        for key in absent:
            del index[key]
        index.update(saved)


def watch_spared_evictions(manager: Any, trace: Trace, block_size: int) -> PagedkvShadow:
    """Wraps vLLM's index insertion, block-pool eviction and ``get_computed_blocks`` (on the
    instances) to follow pagedkv's prefix index (``PagedkvShadow``) and note the first step
    whose look-up gives another hit (or, with a Mamba group, another shared-prefix boundary) on
    it than on vLLM's (``Trace.spared_copy_since``), and the first whose admission takes a hit
    block of which pagedkv indexes another copy, one held where the other is cached-evictable
    (``Trace.other_copy_since``); the shadow, which stops following at the first such look-up."""
    from vllm.v1.core.kv_cache_utils import get_block_hash
    from vllm.v1.kv_cache_interface import MambaSpec

    pool = manager.block_pool
    index_map = pool.cached_block_hash_to_block
    # vLLM's scheduler reads the shared-prefix boundary for a Mamba group only (it ends a
    # prefill chunk there); elsewhere a different boundary changes nothing.
    reads_boundary = any(
        isinstance(group.kv_cache_spec, MambaSpec) for group in manager.kv_cache_config.kv_cache_groups
    )
    shadow = PagedkvShadow(pool)
    insert, evict, lookup = index_map.insert, pool._maybe_evict_cached_block, manager.get_computed_blocks

    def inserting(key: Any, block: Any) -> None:
        if trace.spared_copy_since is None:
            shadow.inserted(key, block)
        insert(key, block)

    def evicting(block: Any) -> Any:
        if trace.spared_copy_since is None and block.block_hash is not None:
            shadow.evicting(block)
        return evict(block)

    def looked_up(request: Any, max_cache_hit_length: int | None = None) -> Any:
        out = lookup(request, max_cache_hit_length)
        if trace.spared_copy_since is None and (shadow.kept or shadow.lost):
            # Only a content the two indexes differ on, at or past the hit (a window group
            # stops below the hit of full attention), can change the hit or the boundary (a
            # group's own hit past it): the cheap test first.
            absent, extra = shadow.differences()
            differing = {get_block_hash(key) for key in absent + extra}
            if any(h in differing for h in request.block_hashes[out[1] // block_size :]):
                limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
                if manager.prefix_cache_lookup_enabled(request):
                    hit, boundary = _hit_with(manager, shadow, request.block_hashes, limit)
                    if hit != out[1] or (reads_boundary and boundary != out[2]):
                        trace.spared_copy_since = len(trace.steps)  # the step being scheduled
        return out

    allocate = manager.allocate_slots

    def allocating(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        blocks = kwargs.get("new_computed_blocks", args[1] if len(args) > 1 else None)
        if trace.spared_copy_since is None and trace.other_copy_since is None and blocks is not None:
            for group in blocks.blocks:
                for block in group:
                    key = block.block_hash
                    ours = None if key is None else shadow.indexed.get(key)
                    if (
                        ours is not None
                        and ours is not block
                        and shadow._is_indexed(key, ours)
                        and (ours.ref_cnt == 0) != (block.ref_cnt == 0)
                    ):
                        trace.other_copy_since = len(trace.steps)  # the step being scheduled
        return allocate(request, num_new_tokens, *args, **kwargs)

    index_map.insert = inserting
    pool._maybe_evict_cached_block = evicting
    manager.get_computed_blocks = looked_up
    manager.allocate_slots = allocating
    return shadow
