"""The blocks of a prefix hit as ``get_computed_blocks`` answers them, looked up when first read.

vLLM's look-up answers the hit's block objects. Its scheduler passes them back to
``allocate_slots`` and reads nothing else of them, and pagedkv's admission takes the blocks
itself (the core's look-up, in the same call), so looking every block up at every look-up would
cost the scheduler's hot path (a waiting request is looked up again each step it waits) for an
answer nobody reads. A ``HitBlocks`` is vLLM's ``KVCacheBlocks`` whose ``blocks`` are looked up
on their first read (the prefix index, each group by vLLM's own rule bounded by the hit:
hybrid_hits.py, so vLLM's rows for the same cached contents) and kept. Read right after the
look-up, or while the admitted request holds them, they are the blocks the admission takes; a
position whose block was evicted before the first read is the null block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from pagedkv.integrations.vllm import hybrid_hits
from pagedkv.integrations.vllm.kv_blocks import PagedkvKVCacheBlocks

# The manager (manager.py) is typed ``Any`` here: manager.py imports admission.py, which imports
# this module, and the package's layering forbids import cycles (tests/python/test_layering.py).
KVCacheManager = Any


class HitBlocks(PagedkvKVCacheBlocks):
    """A hit's blocks (module doc): ``blocks`` is looked up on its first read; everything else
    is ``PagedkvKVCacheBlocks``' (vLLM's class, its answers)."""

    @property
    def blocks(self) -> tuple[Sequence[KVCacheBlock], ...]:
        rows: tuple[Sequence[KVCacheBlock], ...] | None = self.__dict__.get("_rows")
        if rows is None:
            manager, hashes, hit = self.__dict__["_lookup"]
            found, _ = hybrid_hits.find_longest_cache_hit_per_group(manager, hashes, hit)
            num_blocks = hit // manager.block_size
            null = manager._blocks[0]
            rows = tuple(row + [null] * (num_blocks - len(row)) for row in found)
            self.__dict__["_rows"] = rows
        return rows

    @blocks.setter
    def blocks(self, rows: tuple[Sequence[KVCacheBlock], ...]) -> None:
        # (the dataclass's __init__, dataclasses.replace): rows given are the rows
        self.__dict__["_rows"] = rows


def hit_blocks(manager: KVCacheManager, hashes: Sequence[Any], hit: int) -> HitBlocks:
    """``get_computed_blocks``' blocks for a hit of ``hit`` tokens over ``hashes`` (the
    request's own list of block hashes, whose first ones never change), every group, looked up
    when first read. (Built without the dataclass's ``__init__``: one dict entry, on a path the
    scheduler takes for every waiting request every step.)"""
    answer: HitBlocks = object.__new__(HitBlocks)
    answer.__dict__["_lookup"] = (manager, hashes, hit)
    return answer
