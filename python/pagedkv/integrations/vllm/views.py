"""Read-only views of the per-group request maps of vLLM's single-type managers
(``req_to_blocks``, ``num_cached_block``), which KV connectors and vLLM's own tests read through
``coordinator.single_type_managers[g]``: computed from pagedkv's tables on each read, never
written (docs/integrations/vllm.md, KV connectors)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import KVCacheBlock

if TYPE_CHECKING:
    from pagedkv.integrations.vllm.manager import KVCacheManager


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
        if not m.enable_caching:
            raise KeyError(request_id)
        return m._reqs[request_id][4] // m.block_size

    def __iter__(self) -> Iterator[str]:
        m = self._manager
        return iter(m._reqs if m.enable_caching else ())

    def __len__(self) -> int:
        m = self._manager
        return len(m._reqs) if m.enable_caching else 0
