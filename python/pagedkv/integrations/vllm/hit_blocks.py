"""The blocks of a prefix hit as ``get_computed_blocks`` answers them, looked up when first read.

vLLM's look-up answers the hit's block objects. Its scheduler passes them back to
``allocate_slots`` and reads nothing else of them, and pagedkv's admission takes the blocks
itself (the core's look-up, in the same call), so looking every block up at every look-up would
cost the scheduler's hot path (a waiting request is looked up again each step it waits) for an
answer nobody reads. A ``HitRow`` is one group's row of the answer: its length is the hit's;
its blocks are looked up on the first read of any group of the answer (the prefix index, each
group by vLLM's own rule bounded by the hit: hybrid_hits.py, so vLLM's rows for the same cached
contents) and kept. Read right after the look-up, or while the admitted request holds them, they
are the blocks the admission takes; a position whose block was evicted before the first read
is the null block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from pagedkv.integrations.vllm import hybrid_hits

# The manager (manager.py) is typed ``Any`` here: manager.py imports admission.py, which imports
# this module, and the package's layering forbids import cycles (tests/python/test_layering.py).
KVCacheManager = Any


class _HitLookup:
    """The look-up every row of one answer shares: made once, on the first read."""

    __slots__ = ("hashes", "hit", "manager", "rows")

    def __init__(self, manager: KVCacheManager, hashes: Sequence[Any], hit: int) -> None:
        self.manager = manager
        self.hashes = hashes  # the request's own list: its first hashes never change
        self.hit = hit
        self.rows: list[list[KVCacheBlock]] | None = None

    def row(self, group: int) -> list[KVCacheBlock]:
        if self.rows is None:
            found, _ = hybrid_hits.find_longest_cache_hit_per_group(self.manager, self.hashes, self.hit)
            num_blocks = self.hit // self.manager.block_size
            null = self.manager._blocks[0]
            self.rows = [row + [null] * (num_blocks - len(row)) for row in found]
        return self.rows[group]


class HitRow(Sequence[KVCacheBlock]):
    """One group's blocks of a hit (module doc): a read-only sequence of vLLM's block objects,
    equal to a list of the same blocks."""

    __slots__ = ("_group", "_len", "_lookup")

    def __init__(self, lookup: _HitLookup, group: int, num_blocks: int) -> None:
        self._lookup = lookup
        self._group = group
        self._len = num_blocks

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> KVCacheBlock: ...
    @overload
    def __getitem__(self, index: slice) -> list[KVCacheBlock]: ...
    def __getitem__(self, index: int | slice) -> KVCacheBlock | list[KVCacheBlock]:
        return self._lookup.row(self._group)[index]

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self._lookup.row(self._group))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


def hit_blocks(manager: KVCacheManager, hashes: Sequence[Any], hit: int) -> KVCacheBlocks:
    """``get_computed_blocks``' blocks for a hit of ``hit`` tokens over ``hashes`` (the
    request's block hashes), every group, looked up when first read."""
    lookup = _HitLookup(manager, hashes, hit)
    num_blocks = hit // manager.block_size
    return KVCacheBlocks(tuple(HitRow(lookup, g, num_blocks) for g in range(manager.num_kv_cache_groups)))
