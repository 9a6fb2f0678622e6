"""``StagingArena``: a registered host buffer cut into byte ranges, one per staged request
(docs/transfer.md, Staged reads).

A block's rows lie in one region each (per-layer caches), so reading scattered blocks row by
row costs the transport one operation per row; copied block-major into a contiguous range
first, a request's blocks travel in a few large reads (benches/results/2026-12-06-transfer.md
measures both). The arena hands out ranges first-fit, returns them coalesced, and refuses
(``None``) rather than waits when full: the caller then reads row by row.
"""

from __future__ import annotations

import bisect

import numpy as np

from pagedkv.errors import InvalidArgumentError, InvariantViolation

__all__ = ["StagingArena", "pack_blocks", "unpack_blocks"]

_ALIGN = 64  # a cache line: ranges never share one


class StagingArena:
    """``nbytes`` of host memory (``array``, uint8) and the ranges of it in use.

    Invariants (``check``): the free ranges are sorted, disjoint, non-adjacent (coalesced) and
    non-empty; free and used ranges tile ``[0, nbytes)`` exactly."""

    def __init__(self, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < _ALIGN:
            raise InvalidArgumentError(f"a staging arena holds at least {_ALIGN} bytes, got {nbytes!r}")
        self.nbytes = nbytes - nbytes % _ALIGN
        self.array = np.zeros(self.nbytes, dtype=np.uint8)
        self.array[::4096] = 0  # map every page now, not inside the first transfer
        self._free_starts: list[int] = [0]
        self._free_sizes: list[int] = [self.nbytes]
        self._used: dict[int, int] = {}

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def bytes_in_use(self) -> int:
        return sum(self._used.values())

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a free range of at least ``nbytes`` (first fit), or None."""
        need = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        for i, size in enumerate(self._free_sizes):
            if size >= need:
                start = self._free_starts[i]
                if size == need:
                    del self._free_starts[i], self._free_sizes[i]
                else:
                    self._free_starts[i] += need
                    self._free_sizes[i] -= need
                self._used[start] = need
                return start
        return None

    def release(self, offset: int) -> None:
        """Return the range at ``offset``, merged with free neighbours."""
        size = self._used.pop(offset)
        i = bisect.bisect_left(self._free_starts, offset)
        if i < len(self._free_starts) and offset + size == self._free_starts[i]:  # merge right
            size += self._free_sizes[i]
            del self._free_starts[i], self._free_sizes[i]
        if i > 0 and self._free_starts[i - 1] + self._free_sizes[i - 1] == offset:  # merge left
            self._free_sizes[i - 1] += size
        else:
            self._free_starts.insert(i, offset)
            self._free_sizes.insert(i, size)

    def check(self) -> None:
        """``InvariantViolation`` unless the invariants above hold."""
        ranges = sorted([*zip(self._free_starts, self._free_sizes, strict=True), *self._used.items()])
        at = 0
        for start, size in ranges:
            if start != at or size <= 0:
                raise InvariantViolation(f"staging ranges do not tile the arena at byte {at}: {start}+{size}")
            at += size
        if at != self.nbytes:
            raise InvariantViolation(f"staging ranges cover {at} of {self.nbytes} bytes")
        free = list(zip(self._free_starts, self._free_sizes, strict=True))
        for (start, size), (following, _) in zip(free, free[1:], strict=False):
            if start + size >= following:
                raise InvariantViolation(f"free staging ranges at {start} and {following} left unmerged")


def _byte_rows(array: np.ndarray) -> np.ndarray:
    """A C-contiguous block-indexed array as uint8 ``[num_blocks, row_bytes]`` (a view)."""
    return array.reshape(array.shape[0], -1).view(np.uint8)


def pack_blocks(arrays: tuple[np.ndarray, ...], block_ids: np.ndarray, out: np.ndarray) -> None:
    """Copy blocks ``block_ids`` block-major into ``out`` (uint8 ``[len(block_ids),
    block_nbytes]``): row ``i`` of ``out`` is block ``block_ids[i]``'s row of every region, in
    region order, the very bytes ``block_checksum`` streams over."""
    column = 0
    for array in arrays:
        rows = _byte_rows(array)
        width = rows.shape[1]
        out[:, column : column + width] = rows[block_ids]
        column += width


def unpack_blocks(staged: np.ndarray, arrays: tuple[np.ndarray, ...], block_ids: np.ndarray) -> None:
    """The inverse of ``pack_blocks``: row ``i`` of ``staged`` into block ``block_ids[i]``."""
    column = 0
    for array in arrays:
        rows = _byte_rows(array)
        width = rows.shape[1]
        rows[block_ids] = staged[:, column : column + width]
        column += width
