"""Helpers shared by the conformance tests (imported by name, not a conftest).

Mapping conventions are in docs/conformance.md: a fresh pool hands out blocks in ascending id
order; truly free blocks are taken before any cached block is evicted.
"""

from __future__ import annotations

from collections.abc import Sequence

import pagedkv

BS = 16


def manager(num_blocks: int, block_size: int = BS, **kwargs: object) -> pagedkv.KvCacheManager:
    """A manager with prefix caching on (KV events only when asked for)."""
    kwargs.setdefault("enable_prefix_caching", True)
    return pagedkv.KvCacheManager(num_blocks=num_blocks, block_size=block_size, **kwargs)  # type: ignore[arg-type]


def table(kv: pagedkv.KvCacheManager, seq_id: int) -> list[int]:
    return [int(b) for b in kv.block_table(seq_id)]


def refcounts(kv: pagedkv.KvCacheManager) -> list[int]:
    return [kv.refcount(b) for b in range(kv.num_blocks)]


def stored(events: Sequence[object]) -> list[pagedkv.BlockStored]:
    return [e for e in events if isinstance(e, pagedkv.BlockStored)]


def removed_hashes(events: Sequence[object]) -> list[int]:
    return [h for e in events if isinstance(e, pagedkv.BlockRemoved) for h in e.block_hashes]


def evict_cached(kv: pagedkv.KvCacheManager, count: int, seq_id: int) -> list[int]:
    """Evicts exactly ``count`` cached blocks and returns them in eviction order.

    A sequence of bare token counts (never hashed, so never cached) takes every truly free
    block and then ``count`` cached ones; it is freed again, so its blocks go back to the free
    list and the index keeps everything that was not evicted."""
    num_free = kv.pool.num_free_blocks
    kv.add_sequence(seq_id, num_tokens=(num_free + count) * kv.block_size)
    evicted = table(kv, seq_id)[num_free:]
    kv.free(seq_id)
    return evicted
