"""Helpers shared by the Python API tests of pagedkv (imported by name, not a conftest)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pagedkv


def snapshot(kv: pagedkv.KvCacheManager, seq_ids: Iterable[int]) -> dict[str, Any]:
    """Everything observable about `kv` for the given sequences, to assert a failed operation
    changed nothing: tables, token counts, every block's refcount, free counts and stats."""
    tables = {}
    for seq_id in sorted(set(seq_ids)):
        if seq_id in kv:
            swapped = kv.num_host_blocks > 0 and kv.is_swapped_out(seq_id)
            table = None if swapped else kv.block_table(seq_id).tolist()
            tables[seq_id] = (table, kv.num_tokens(seq_id), kv.num_computed_tokens(seq_id), swapped)
    return {
        "tables": tables,
        "num_sequences": kv.num_sequences,
        "refcounts": [kv.refcount(b) for b in range(kv.num_blocks)],
        "num_free_blocks": kv.num_free_blocks,
        "stats": kv.stats(),
    }


def blocks_in_use(kv: pagedkv.KvCacheManager) -> int:
    return int(kv.stats()["num_blocks_in_use"])


def as_list(array: np.ndarray) -> list[Any]:
    return [list(map(int, row)) if np.ndim(row) else int(row) for row in array]
