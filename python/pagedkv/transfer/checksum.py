"""Per-block integrity: the XXH3-64 of one block's bytes over every cache region.

The prefill side computes it when it hands a request out (the checksums travel in the params);
the decode side recomputes it over the rows it received and reports a block whose sum differs
as failed, so a block corrupted in memory, torn by a transport error, or overwritten because the
prefill side reused it after its lease ran out is recomputed, never attended over
(docs/transfer.md, Failure handling). XXH3 as the offload stores use it (``pagedkv.offload.codec``):
it detects accidental corruption, not a forger.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

__all__ = ["block_checksum", "block_checksums"]


def block_checksum(arrays: Sequence[np.ndarray], block_id: int) -> int:
    """XXH3-64 of row ``block_id`` of each array, in order (one stream)."""
    h = xxhash.xxh3_64()
    for array in arrays:
        h.update(array[block_id])
    return h.intdigest()


def block_checksums(arrays: Sequence[np.ndarray], block_ids: Iterable[int]) -> list[int]:
    """``block_checksum`` of each block."""
    return [block_checksum(arrays, int(b)) for b in block_ids]
