"""What vLLM's scheduler, its KV connectors and vLLM's tests read of vLLM's manager internals,
as views of pagedkv's manager: the coordinator (``coordinator``), its per-group managers
(``single_type_managers[g]``: block size, spec, the read-only per-request maps ``req_to_blocks``
and ``num_cached_block``, computed from pagedkv's tables on each read) and the block pool
(free blocks, usage, deferred frees, the look-up by one block hash, and the free queue's
count and per-block reference counts vLLM's tests read). Nothing here holds state of its own
(docs/integrations/vllm.md, KV connectors)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import KVCacheSpec

from pagedkv.integrations.vllm import aux_outputs, connector, hybrid_hits
from pagedkv.integrations.vllm.pool_views import FreeBlockQueueView, PoolBlocksView

# The manager (manager.py) is typed ``Any`` here: manager.py imports this module, and the
# package's layering forbids import cycles, typing-only ones included (tests/python/test_layering.py).
KVCacheManager = Any


class RequestBlocks(Mapping[str, list[KVCacheBlock]]):
    """``req_to_blocks`` of group ``group``: request id -> its blocks there (a released window
    position is the null block, as in vLLM)."""

    def __init__(self, manager: KVCacheManager, group: int) -> None:
        self._manager = manager
        self._group = group

    def __getitem__(self, request_id: str) -> list[KVCacheBlock]:
        m = self._manager
        seq_id = m._reqs[request_id][0]
        blocks = m._blocks
        return [blocks[b] for b in m._core.block_table(seq_id, group=self._group).tolist()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._manager._reqs)

    def __len__(self) -> int:
        return len(self._manager._reqs)


class CachedBlocks(Mapping[str, int]):
    """``num_cached_block``: request id -> its blocks in the prefix cache (the blocks of
    ``estimate_cached_tokens``); empty without prefix caching, as vLLM caches nothing then."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager

    def __getitem__(self, request_id: str) -> int:
        m = self._manager
        # Nothing is cached without prefix caching: the lookup misses (KeyError) then.
        return (m._reqs if m.enable_caching else {})[request_id][4] // m.block_size

    def __iter__(self) -> Iterator[str]:
        m = self._manager
        return iter(m._reqs if m.enable_caching else ())

    def __len__(self) -> int:
        m = self._manager
        return len(m._reqs) if m.enable_caching else 0


class GroupView:
    """What the scheduler reads of vLLM's per-group manager: ``block_size``, ``kv_cache_spec``."""

    def __init__(self, manager: KVCacheManager, group_id: int, spec: KVCacheSpec) -> None:
        self.kv_cache_group_id = group_id
        self.kv_cache_spec = spec
        self.block_size = spec.block_size
        self.retains_longer_hit = False
        self.block_pool = manager.block_pool
        # Read-only views of vLLM's per-request maps (KV connectors read them; views.py).
        self.req_to_blocks = RequestBlocks(manager, group_id)
        self.num_cached_block = CachedBlocks(manager)


class BlockPoolView:
    """What the scheduler and vLLM's tests read of vLLM's ``BlockPool``: free blocks, usage."""

    def __init__(self, manager: KVCacheManager, num_blocks: int, block_size: int) -> None:
        self._manager = manager
        self._core = manager._core
        self.num_gpu_blocks = num_blocks
        self.hash_block_size = block_size
        # Read-only views of vLLM's pool internals, read from the core (pool_views.py).
        self.free_block_queue = FreeBlockQueueView(self._core)
        self.blocks = PoolBlocksView(self._core, num_blocks)

    def get_num_free_blocks(self) -> int:
        # Free-list plus cached-evictable blocks, block 0 (the null block) excluded, as vLLM's
        # free block queue counts them.
        return int(self._core.num_free_blocks)

    def get_usage(self) -> float:
        total = self._manager.capacity.usable_blocks  # the null block is never usable
        if total <= 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def free_blocks(self, blocks: Any) -> None:
        """Returns the blocks ``pop_blocks_for_free`` handed out (a deferred free)."""
        self._manager._deferred.free(self._manager, blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """vLLM's ``BlockPool.evict_blocks``: the manager's (evict.py)."""
        self._manager.evict_blocks(block_ids)

    def get_cached_block(self, block_hash: Any, kv_cache_group_ids: list[int]) -> Any:
        """vLLM's look-up of one cached block by its hash alone (the auxiliary-output
        connector's; aux_outputs.py)."""
        return aux_outputs.get_cached_block(self._manager, block_hash, kv_cache_group_ids)


class CoordinatorView:
    """What the scheduler reads of vLLM's coordinator at construction and per step."""

    def __init__(self, manager: KVCacheManager, groups: list[GroupView], block_pool: BlockPoolView) -> None:
        self._manager = manager
        self.single_type_managers = groups
        self.block_pool = block_pool
        # Accepted only where it changes nothing here (support.py).
        self.retention_interval = manager.kv_cache_config.prefix_cache_retention_interval
        self.enable_partial_hash_hits = False
        self.eagle_group_ids: tuple[int, ...] = ()
        self.num_reprefillable_tokens = 0
        # The group vLLM's auxiliary-output connector asks about (aux_outputs.py).
        self.full_attention_group_id = aux_outputs.full_attention_group_id(
            manager.kv_cache_config, manager.enable_caching
        )

    def new_step_starts(self) -> None:
        self._manager.new_step_starts()  # a Mamba group's same-step states (the core's)

    def find_longest_cache_hit_per_group(
        self, block_hashes: Any, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Each group's own hit (a KV connector's look-up; hybrid_hits.py)."""
        return hybrid_hits.find_longest_cache_hit_per_group(self._manager, block_hashes, max_cache_hit_length)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        total_computed_tokens: int = 0,
        apply_admission_cap: bool = False,
        **_: Any,
    ) -> int:
        """The blocks a request without new hits still needs for ``num_tokens`` slots (the
        scheduler's reservation for in-flight KV loads; connector.py)."""
        return connector.num_blocks_to_allocate(
            self._manager, request_id, num_tokens, total_computed_tokens, apply_admission_cap
        )


class HybridCoordinatorView(CoordinatorView, HybridKVCacheCoordinator):
    """The coordinator view of a config with several KV groups and prefix caching, where vLLM
    builds a ``HybridKVCacheCoordinator``: an instance of vLLM's class, for the code that checks
    it (vLLM's ``get_computed_blocks_for_connector``, its offloading connector, its tests).
    Only ``CoordinatorView.__init__`` runs, so a method of vLLM's class this view does not
    answer reads coordinator state that does not exist here and raises ``AttributeError``
    (or reaches a per-group manager method the group view does not have): never an answer from
    vLLM's machinery on pagedkv's tables."""

    __init__ = CoordinatorView.__init__


def coordinator_view_class(enable_caching: bool, num_groups: int) -> type[CoordinatorView]:
    """vLLM's choice of coordinator class (``get_kv_cache_coordinator``): the hybrid one for
    several groups with prefix caching, else the plain view."""
    return HybridCoordinatorView if enable_caching and num_groups > 1 else CoordinatorView
