"""Paged attention equals contiguous attention, through real scattered block tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pagedkv.sim.reports import Number, format_table


def attention_check(
    *,
    seq_lens: Sequence[int] = (1, 17, 100, 333, 1000),
    block_size: int = 16,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    seed: int = 0,
    backend: str = "numpy",
    tolerance: float = 1e-5,
) -> dict:
    """Write random keys and values through real block tables whose blocks are scattered over the
    pool, run paged attention over them, and compare with contiguous attention on the same tensors.
    Raises `InvariantViolation` when any output differs by more than ``tolerance``."""
    import pagedkv
    from pagedkv import attention
    from pagedkv.attention.runners import get_runner
    from pagedkv.errors import InvariantViolation

    # The cuda backend takes and returns CuPy arrays; the others NumPy arrays.
    if backend == "cuda":
        # Raises CudaUnavailableError (a PagedKvError) without CuPy or a device.
        cupy = get_runner("cuda").xp
        to_device, to_host = cupy.asarray, cupy.asnumpy
    else:

        def to_device(array: np.ndarray) -> np.ndarray:
            return array

        def to_host(array: np.ndarray) -> np.ndarray:
            return np.asarray(array)

    rng = np.random.default_rng(seed)
    total_blocks = sum(-(-length // block_size) for length in seq_lens)
    manager = pagedkv.KvCacheManager(num_blocks=total_blocks + 8, block_size=block_size)
    # Grow all sequences a block at a time, as decoding interleaves them, so that each table's
    # blocks are scattered over the pool rather than one run.
    for index, length in enumerate(seq_lens):
        manager.add_sequence(index, num_tokens=min(length, block_size))
    growing = True
    while growing:
        growing = False
        for index, length in enumerate(seq_lens):
            missing = length - manager.num_tokens(index)
            if missing > 0:
                manager.append_tokens(index, num_tokens=min(missing, block_size))
                growing = True
    cache_shape = (manager.num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = to_device(np.zeros(cache_shape, dtype=np.float32))
    v_cache = to_device(np.zeros(cache_shape, dtype=np.float32))
    keys, values = [], []
    for index, length in enumerate(seq_lens):
        k = rng.standard_normal((length, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((length, num_kv_heads, head_dim)).astype(np.float32)
        attention.write_kv(
            to_device(k),
            to_device(v),
            k_cache,
            v_cache,
            to_device(manager.slot_mapping([index], length)),
            backend=backend,
        )
        keys.append(k)
        values.append(v)
    seq_ids = list(range(len(seq_lens)))
    block_tables, lens = manager.batch_block_tables(seq_ids)
    q = rng.standard_normal((len(seq_lens), num_q_heads, head_dim)).astype(np.float32)
    paged = to_host(
        attention.paged_attention(
            to_device(q), k_cache, v_cache, to_device(block_tables), to_device(lens), backend=backend
        )
    )
    rows = []
    for index, length in enumerate(seq_lens):
        reference = attention.contiguous_attention(q[index], keys[index], values[index], backend="numpy")
        table = manager.block_table(index)
        rows.append(
            {
                "seq_len": int(length),
                "blocks": int(table.size),
                "scattered": bool(np.any(np.diff(table) != 1)) if table.size > 1 else False,
                "max_abs_diff": float(np.max(np.abs(paged[index] - reference))),
            }
        )
    worst = max(row["max_abs_diff"] for row in rows)
    result = {
        "backend": backend,
        "block_size": block_size,
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "tolerance": tolerance,
        "rows": rows,
        "max_abs_diff": worst,
        "equal": worst <= tolerance,
    }
    if worst > tolerance:
        raise InvariantViolation(
            f"paged attention differs from contiguous attention by {worst:.3g} "
            f"(> {tolerance:g}) on the {backend} backend"
        )
    return result


def render_attention_check(data: Mapping[str, Any]) -> str:
    rows = [
        [row["seq_len"], row["blocks"], row["scattered"], Number(row["max_abs_diff"], ".2e")]
        for row in data["rows"]
    ]
    return format_table(
        ["seq len", "blocks", "scattered blocks", "max |paged - contiguous|"],
        rows,
        title=(
            f"Paged attention = contiguous attention ({data['backend']} backend, fp32, block size "
            f"{data['block_size']}, {data['num_q_heads']} query / {data['num_kv_heads']} KV heads of "
            f"{data['head_dim']})"
        ),
        note=f"max difference {data['max_abs_diff']:.2e} <= tolerance {data['tolerance']:g}: equal",
    )
