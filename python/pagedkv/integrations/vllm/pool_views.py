"""Read-only views of vLLM's ``BlockPool`` internals that vLLM's tests read
(``free_block_queue.num_free_blocks``, ``blocks[i].ref_cnt``), computed from pagedkv's core
on every read: nothing is kept here, so what a test asserts of them is pagedkv's state."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

# The core (`pagedkv.KvCacheManager`, with ``null_block=0``), typed ``Any`` as in views.py.
Core = Any


class FreeBlockQueueView:
    """vLLM's ``free_block_queue``: ``num_free_blocks`` is the free and cached-evictable blocks
    (block 0, the null block, never among them), the core's ``num_free_blocks``."""

    def __init__(self, core: Core) -> None:
        self._core = core

    @property
    def num_free_blocks(self) -> int:
        return int(self._core.num_free_blocks)


class PoolBlockView:
    """One pool block as vLLM's ``KVCacheBlock`` is read by tests: ``block_id``, ``ref_cnt``
    (the core's reference count), ``is_null``."""

    __slots__ = ("_core", "block_id")

    def __init__(self, core: Core, block_id: int) -> None:
        self._core = core
        self.block_id = block_id

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    @property
    def ref_cnt(self) -> int:
        count = int(self._core.refcount(self.block_id))
        # The core holds one reference to block 0 for as long as it reserves it as the null
        # block (released window positions add none); vLLM does not count references to its
        # null block (its ref_cnt stays 0). Any other reference still shows.
        return count - 1 if self.block_id == 0 else count

    def __repr__(self) -> str:
        return f"PoolBlockView(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class PoolBlocksView(Sequence[PoolBlockView]):
    """vLLM's ``block_pool.blocks``: every block of the pool, by id."""

    def __init__(self, core: Core, num_blocks: int) -> None:
        self._core = core
        self._num_blocks = num_blocks

    def __len__(self) -> int:
        return self._num_blocks

    @overload
    def __getitem__(self, index: int) -> PoolBlockView: ...
    @overload
    def __getitem__(self, index: slice) -> list[PoolBlockView]: ...
    def __getitem__(self, index: int | slice) -> PoolBlockView | list[PoolBlockView]:
        if isinstance(index, slice):
            return [PoolBlockView(self._core, i) for i in range(self._num_blocks)[index]]
        i = range(self._num_blocks)[index]  # IndexError past the pool, negatives from the end
        return PoolBlockView(self._core, i)

    def __iter__(self) -> Iterator[PoolBlockView]:
        return (PoolBlockView(self._core, i) for i in range(self._num_blocks))
