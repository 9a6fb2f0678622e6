"""The per-request queries of pagedkv's vLLM manager: a request's blocks (vLLM's own
``KVCacheBlock`` objects in its ``KVCacheBlocks``) and block ids, per group, and its cached-token
estimate, read from the core's block tables and the manager's records (records.py).

The functions are the manager's methods (manager.py binds each as a class attribute, so a call
costs what a method defined there costs); ``manager`` is the ``KVCacheManager``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from pagedkv.integrations.vllm.capacity import cdiv
from pagedkv.integrations.vllm.kv_blocks import PagedkvKVCacheBlocks

# The manager (manager.py) is typed ``Any`` here: manager.py imports this module, and the
# package's layering forbids import cycles, typing-only ones included (tests/python/test_layering.py).
KVCacheManager = Any


def blocks_of(manager: KVCacheManager, seq_id: int, start: int) -> KVCacheBlocks:
    """The request's blocks from table position ``start`` on, every group."""
    block = manager._blocks.__getitem__
    table = manager._core.block_table
    if manager.num_kv_cache_groups == 1:  # the common case, without the generator
        row = table(seq_id)
        if row.size == start + 1:  # one block (a decode step's new one): no slice, no list
            return PagedkvKVCacheBlocks(([block(row.item(start))],))
        ids = row[start:].tolist()
        return PagedkvKVCacheBlocks((list(map(block, ids)),)) if ids else manager.empty_kv_cache_blocks
    if manager._cross is not None:
        return manager._cross.blocks_of(manager, seq_id, start)
    groups = tuple(
        list(map(block, table(seq_id, group=g)[start:].tolist())) for g in range(manager.num_kv_cache_groups)
    )
    return PagedkvKVCacheBlocks(groups) if any(groups) else manager.empty_kv_cache_blocks


def get_blocks(manager: KVCacheManager, request_id: str) -> KVCacheBlocks:
    """All blocks of a request (released window positions are the null block)."""
    state = manager._reqs.get(request_id)
    if state is None:
        return manager.empty_kv_cache_blocks
    return manager._blocks_of(state[0], 0)


def get_block_ids(manager: KVCacheManager, request_id: str) -> tuple[list[int], ...]:
    """The block ids of a request, per group."""
    state = manager._reqs.get(request_id)
    if state is None:
        return tuple([] for _ in range(manager.num_kv_cache_groups))
    if manager._cross is not None:
        return manager._cross.block_ids(manager, state[0])
    return tuple(
        manager._core.block_table(state[0], group=g).tolist() for g in range(manager.num_kv_cache_groups)
    )


def get_block_ids_for_computed_tokens(
    manager: KVCacheManager, request_id: str, num_computed_tokens: int
) -> tuple[list[int], ...]:
    """The block ids covering the request's first ``num_computed_tokens`` tokens."""
    n = cdiv(num_computed_tokens, manager.block_size)
    if manager._cross is not None:  # a cross-attention group's encoder blocks are whole
        return manager._cross.clip(manager.get_block_ids(request_id), n)
    return tuple(ids[:n] for ids in manager.get_block_ids(request_id))


def estimate_cached_tokens(manager: KVCacheManager, request: Request) -> int:
    """Tokens of the request whose blocks are in the prefix cache (block-aligned)."""
    state = manager._reqs.get(request.request_id)
    if state is None or not manager.enable_caching:
        return 0
    return state[4]


def get_num_common_prefix_blocks(manager: KVCacheManager, running_request_id: str) -> list[int]:
    """vLLM's deprecated cascade-attention query: 0 per group."""
    return [0] * manager.num_kv_cache_groups


def create_kv_cache_blocks(
    manager: KVCacheManager, blocks: tuple[Sequence[KVCacheBlock], ...]
) -> KVCacheBlocks:
    """vLLM's ``KVCacheBlocks`` of ``blocks`` (the shared empty one when all are empty)."""
    return PagedkvKVCacheBlocks(blocks) if any(blocks) else manager.empty_kv_cache_blocks
