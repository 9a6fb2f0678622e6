"""NumPy reference implementations (``backend="numpy"``).

Bit-identity between ``paged_attention`` and ``contiguous_attention`` is by construction: the
paged path gathers each sequence's keys and values block by block into a fresh contiguous
``[seq_len, num_kv_heads, head_dim]`` array (a pure copy, so the values are identical) and then
both paths run the same ``attend`` on arrays of identical shape and layout. ``attend`` itself uses
only elementwise operations and explicit sequential sums (no BLAS, whose summation order may
depend on memory alignment), so equal inputs give equal bits in fp32 and fp64.

16-bit inputs are widened to fp32 (the kernels' accumulation type) and the output is rounded
back to the input dtype.
"""

from __future__ import annotations

import numpy as np

from pagedkv.attention import cache_op_validation as cval
from pagedkv.attention import copy_planning
from pagedkv.attention import validation as val
from pagedkv.attention.dtypes import compute_dtype, from_compute, to_compute
from pagedkv.attention.prefill_reference import check_within_cache


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Softmax attention of one query token over a contiguous history.

    q: [num_q_heads, head_dim]; k, v: [seq_len, num_kv_heads, head_dim]; all the same float dtype
    (the accumulation type). Query head h uses KV head h // (num_q_heads // num_kv_heads).
    Returns [num_q_heads, head_dim]; zeros for an empty history.
    """
    seq_len, num_kv_heads, head_dim = k.shape
    num_q_heads = q.shape[0]
    group = num_q_heads // num_kv_heads
    dtype = q.dtype
    if seq_len == 0:
        return np.zeros((num_q_heads, head_dim), dtype=dtype)
    qg = np.ascontiguousarray(q).reshape(num_kv_heads, group, head_dim)
    kt = np.ascontiguousarray(k.transpose(1, 0, 2))  # [num_kv_heads, seq_len, head_dim]
    vt = np.ascontiguousarray(v.transpose(1, 0, 2))
    scores = np.zeros((num_kv_heads, group, seq_len), dtype=dtype)
    for d in range(head_dim):
        scores += qg[:, :, d, None] * kt[:, None, :, d]
    scores *= dtype.type(scale)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    denom = np.zeros((num_kv_heads, group), dtype=dtype)
    acc = np.zeros((num_kv_heads, group, head_dim), dtype=dtype)
    for s in range(seq_len):
        denom += probs[:, :, s]
        acc += probs[:, :, s, None] * vt[:, None, s, :]
    out = acc / denom[:, :, None]
    return out.reshape(num_q_heads, head_dim)


def contiguous_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None) -> np.ndarray:
    shape = val.check_contiguous_attention(q, k, v, scale, backend="numpy")
    out = attend(
        np.array(to_compute(q, shape.kind), order="C"),
        np.array(to_compute(k, shape.kind), order="C"),
        np.array(to_compute(v, shape.kind), order="C"),
        shape.scale,
    )
    return from_compute(out, shape.kind, q.dtype)


def gather_sequence(
    cache: np.ndarray, table_row: np.ndarray, seq_len: int, kind: str, start: int = 0
) -> np.ndarray:
    """Positions ``start .. seq_len - 1`` of one sequence's history [seq_len - start, num_kv_heads,
    head_dim] copied block by block out of ``cache`` [num_blocks, block_size, num_kv_heads,
    head_dim] through ``table_row`` [max_blocks]; the blocks before ``start``'s are never read."""
    block_size = cache.shape[1]
    out = np.empty((seq_len - start, *cache.shape[2:]), dtype=compute_dtype(kind))
    for i in range(start // block_size, -(-seq_len // block_size)):
        lo, hi = max(start, i * block_size), min(seq_len, (i + 1) * block_size)
        block = cache[int(table_row[i]), lo - i * block_size : hi - i * block_size]
        out[lo - start : hi - start] = to_compute(block, kind)
    return out


def paged_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float | None,
    window: int | None = None,
) -> np.ndarray:
    """With a sliding ``window`` the query (at position seq_len - 1) attends to the last
    ``window`` keys only: the same ``attend`` over the gathered window, so the result equals
    ``contiguous_attention`` over ``k[seq_len - window:]`` bit for bit."""
    shape = val.check_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, backend="numpy", window=window
    )
    out = np.empty(q.shape, dtype=q.dtype)
    for b in range(shape.num_seqs):
        n = int(seq_lens[b])
        start = 0 if window is None else max(0, n - window)
        check_within_cache(b, n - start, k_cache.shape[0], k_cache.shape[1])
        k = gather_sequence(k_cache, block_tables[b], n, shape.kind, start)
        v = gather_sequence(v_cache, block_tables[b], n, shape.kind, start)
        qb = np.array(to_compute(q[b], shape.kind), order="C")
        out[b] = from_compute(attend(qb, k, v, shape.scale), shape.kind, q.dtype)
    return out


def write_kv(
    k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray
) -> None:
    cval.check_write_kv(k, v, k_cache, v_cache, slot_mapping, backend="numpy")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    rows = k_cache.shape[0] * k_cache.shape[1]
    k_cache.reshape(rows, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.reshape(rows, *v_cache.shape[2:])[slots] = v[keep]


def copy_blocks(k_caches: list[np.ndarray], v_caches: list[np.ndarray], copy_ops: np.ndarray) -> None:
    _, ops = cval.check_copy_blocks(k_caches, v_caches, copy_ops, backend="numpy")
    for src, dst in ops.tolist():
        for cache in (*k_caches, *v_caches):
            cache[dst] = cache[src]


def swap_blocks(src_cache: np.ndarray, dst_cache: np.ndarray, mapping: np.ndarray) -> int:
    cval.check_swap_blocks(src_cache, dst_cache, mapping, backend="numpy")
    runs = copy_planning.merge_runs(mapping)
    for src, dst, count in runs:
        dst_cache[dst : dst + count] = src_cache[src : src + count]
    return len(runs)
