"""The per-step calls of pagedkv's vLLM manager: what vLLM 0.33's scheduler takes from it once a
step (new block ids to zero, KV-cache events, prefix-cache stats, Mamba's copies and boundary
states, which pagedkv never has) and the prefix-cache counters it feeds per admission.

The functions are the manager's methods (manager.py binds each as a class attribute, so a call
costs what a method defined there costs); ``manager`` is the ``KVCacheManager``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations.vllm import mamba

# The manager (manager.py) is typed ``Any`` here: manager.py imports this module, and the
# package's layering forbids import cycles, typing-only ones included (tests/python/test_layering.py).
KVCacheManager = Any


def usage(manager: KVCacheManager) -> float:
    """The KV cache usage in [0, 1], vLLM's denominator (the null block excluded)."""
    return manager.block_pool.get_usage()


def new_step_starts(manager: KVCacheManager) -> None:
    """A Mamba group's same-step states are forgotten (the core's ``new_step``), and the
    diverged hits of the last step's look-ups (hybrid_hits.py); nothing for attention groups."""
    if manager.capacity.has_state:
        manager._core.new_step()
    if manager._diverged_hits:
        manager._diverged_hits.clear()


def take_kv_cache_block_copies(manager: KVCacheManager) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
    """No copies: hits are whole blocks (hash block size = block size), never copied."""
    return [], []


def take_boundary_state_offloads(manager: KVCacheManager) -> dict[str, list[tuple[int, int, int]]]:
    """The Mamba groups' boundary states cached since the last call, for a KV connector to
    offload (mamba.py; none without a Mamba group)."""
    if not manager._state_offers:
        return {}
    return mamba.take_offers(manager)


def take_new_block_ids(manager: KVCacheManager) -> list[int]:
    """Blocks allocated since the last call, for zeroing (when the config asks for it)."""
    if not manager._record_new_block_ids:
        return []
    seqs, groups, positions, block_ids, fresh = manager._core.take_new_block_ids()
    for seq_id, skipped, start, end in manager._unzeroed:  # async loads' blocks (admission.py)
        fresh &= ~((seqs == seq_id) & np.isin(groups, skipped) & (positions >= start) & (positions < end))
    manager._unzeroed.clear()
    if manager._state_groups:
        # vLLM's per-group managers record new blocks for attention groups only (an
        # AttentionSpec's): a Mamba group's state blocks are not in its list, so not here.
        fresh &= ~np.isin(groups, manager._state_groups)
    ids = [int(b) for b in block_ids[fresh]]
    if manager._cross is not None:
        ids += manager._cross.take_new_block_ids()
    if manager._zero_again:
        ids += manager._zero_again
        manager._zero_again = []
    return ids


def record_blocks_for_zeroing(manager: KVCacheManager, request_id: str, start_token: int) -> None:
    """Zeroes the request's blocks from ``start_token`` (block-aligned) on again at the next
    ``take_new_block_ids``: blocks a failed async KV load left unwritten."""
    if not manager._record_new_block_ids:
        return
    if start_token % manager.block_size:
        raise InvalidArgumentError(f"start_token {start_token} is not block-aligned")
    start = start_token // manager.block_size
    for group, ids in enumerate(manager.get_block_ids(request_id)):
        if group not in manager._state_groups:  # attention groups only, as take_new_block_ids
            manager._zero_again.extend(b for b in ids[start:] if b != 0)


def take_events(manager: KVCacheManager) -> list[Any]:
    """vLLM's KV-cache events since the last call (vLLM's classes and hashes)."""
    if manager._events is None:
        return []
    return manager._events.take()


def make_prefix_cache_stats(manager: KVCacheManager) -> PrefixCacheStats | None:
    """The prefix-cache stats since the last call (and a fresh counter), or None."""
    if not manager.log_stats:
        return None
    stats = manager.prefix_cache_stats
    manager.prefix_cache_stats = PrefixCacheStats()
    return stats


def prefix_cache_lookup_enabled(manager: KVCacheManager, request: Request) -> bool:
    """Whether a local prefix-cache lookup may run for this request."""
    return manager.enable_caching and not request.skip_reading_prefix_cache


def record_prefix_cache_stats(manager: KVCacheManager, request: Request, num_hits: int) -> None:
    """Counts one admission's query and hit (requests that skipped the lookup excluded)."""
    if not manager.log_stats or not manager.prefix_cache_lookup_enabled(request):
        return
    assert manager.prefix_cache_stats is not None
    manager.prefix_cache_stats.record(
        num_tokens=request.num_tokens,
        num_hits=num_hits,
        preempted=request.num_preemptions > 0,
    )


def collect_events(manager: KVCacheManager, request: Request | None, cached_tokens: int = 0) -> None:
    """Drains the core's events of a call made for ``request`` that cached its first
    ``cached_tokens`` tokens (when events are on; events.py)."""
    if manager._events is not None:
        manager._events.collect(request, cached_tokens)


def reset_prefix_cache(manager: KVCacheManager) -> bool:
    """Drops every cached block no request holds; False when some are still held."""
    if not manager._core.reset_prefix_cache():
        return False
    if manager.log_stats:
        assert manager.prefix_cache_stats is not None
        manager.prefix_cache_stats.reset = True
    return True


def finalize_partial_tail_offloads(manager: KVCacheManager, request: Request) -> list[tuple[int, int, int]]:
    """No Mamba groups, so no partial-tail boundary states to hand a connector."""
    return []
