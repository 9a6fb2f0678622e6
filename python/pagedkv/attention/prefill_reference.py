"""NumPy reference of paged prefill attention (``backend="numpy"``).

Sequence i's ``q_len = query_start_loc[i+1] - query_start_loc[i]`` queries are its last ``q_len``
positions ``seq_len - q_len .. seq_len - 1``; with ``causal`` the query at position p attends to
keys ``0..p``, otherwise to all ``seq_len`` keys.

Bit identity with ``contiguous_attention`` (one query over ``k[:p+1]``) is by construction, as in
``reference.paged_attention``: keys and values are gathered block by block into a contiguous copy,
and ``attend_rows`` performs, for every (query, head, key) element, exactly the operations
``reference.attend`` performs in the same order. Keys past a query's position are excluded by
-inf scores (exact under ``max``, exp gives +0.0, and adding +0.0 to a positive denominator
changes no bit), and their values are skipped with ``np.where`` rather than multiplied by zero,
so a non-finite value in a masked-out token cannot leak in as 0 * inf = NaN.
"""

from __future__ import annotations

import numpy as np

from pagedkv.attention import prefill_validation as pval
from pagedkv.attention.dtypes import compute_dtype, from_compute, to_compute
from pagedkv.attention.window import first_visible_key
from pagedkv.errors import InvalidArgumentError

# Score elements held at once (per chunk of query rows): bounds the reference's memory on long
# prompts, e.g. 8K queries x 8K keys x 32 heads would otherwise be an 8 GiB score tensor.
MAX_SCORE_ELEMENTS = 1 << 22


def attend_rows(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    num_keys: np.ndarray,
    scale: float,
    first_keys: np.ndarray | None = None,
) -> np.ndarray:
    """Softmax attention of several query tokens over one contiguous history.

    q: [num_rows, num_q_heads, head_dim]; k, v: [seq_len, num_kv_heads, head_dim], one float dtype
    (the accumulation type); num_keys: int [num_rows], row r attends to keys
    first_keys[r]..num_keys[r]-1 (first_keys default 0; at least one key per row, all within
    seq_len). Returns [num_rows, num_q_heads, head_dim].

    Keys before first_keys[r] are masked exactly like keys past num_keys[r]: their -inf scores add
    +0.0 to the denominator before the first visible key and their values are skipped, so a row
    equals ``reference.attend`` over k[first_keys[r]:num_keys[r]] bit for bit.
    """
    num_rows, num_q_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    dtype = q.dtype
    # [num_kv_heads, group, num_rows, head_dim]: the same per-element values attend() uses.
    qg = np.ascontiguousarray(q.reshape(num_rows, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3))
    kt = np.ascontiguousarray(k.transpose(1, 0, 2))  # [num_kv_heads, seq_len, head_dim]
    vt = np.ascontiguousarray(v.transpose(1, 0, 2))
    visible = np.arange(seq_len)[None, :] < num_keys[:, None]  # [num_rows, seq_len]
    if first_keys is not None:
        visible &= np.arange(seq_len)[None, :] >= first_keys[:, None]
    scores = np.zeros((num_kv_heads, group, num_rows, seq_len), dtype=dtype)
    for d in range(head_dim):
        scores += qg[:, :, :, d, None] * kt[:, None, None, :, d]
    scores *= dtype.type(scale)
    scores = np.where(visible, scores, dtype.type(-np.inf))
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    denom = np.zeros((num_kv_heads, group, num_rows), dtype=dtype)
    acc = np.zeros((num_kv_heads, group, num_rows, head_dim), dtype=dtype)
    with np.errstate(invalid="ignore", over="ignore"):  # discarded 0 * inf of masked-out rows
        for s in range(seq_len):
            denom += probs[:, :, :, s]
            # Rows that see key s accumulate it; the others keep acc untouched (no 0 * v products).
            step = acc + probs[:, :, :, s, None] * vt[:, None, None, s, :]
            acc = np.where(visible[:, s, None], step, acc)
    out = acc / denom[:, :, :, None]
    return np.ascontiguousarray(out.transpose(2, 0, 1, 3)).reshape(num_rows, num_q_heads, head_dim)


def gather_rows(cache: np.ndarray, blocks: np.ndarray, seq_len: int, kind: str) -> np.ndarray:
    """One sequence's history [seq_len, num_kv_heads, head_dim] (accumulation type) copied out of
    ``cache`` through its block ids ``blocks`` (at least ceil(seq_len / block_size) of them)."""
    block_size = cache.shape[1]
    out = np.empty((seq_len, *cache.shape[2:]), dtype=compute_dtype(kind))
    for i in range(-(-seq_len // block_size)):
        n = min(block_size, seq_len - i * block_size)
        out[i * block_size : i * block_size + n] = to_compute(cache[int(blocks[i]), :n], kind)
    return out


def check_within_cache(seq: int, num_keys: int, num_blocks: int, block_size: int) -> None:
    """Refuses to gather more keys for one sequence than the caches hold (``num_blocks *
    block_size`` tokens).

    The kernels stream a sequence's keys block by block and hold no copy of them; this reference
    gathers the keys a sequence's queries can see into one contiguous array (``gather_rows``), so
    a table that repeats a block would size that copy from the table instead of the cache (a 4 MiB
    table repeating block 0 against a 128 KiB cache asked for 64 GiB) and loop over every repeat.
    Distinct positions cannot outnumber the cache's slots; with this bound the copies are at most
    the caches' size (in the accumulation type) and the work at most q rows x that. With a sliding
    window only the visible span counts: a long sequence whose released blocks are -1 passes.
    """
    capacity = num_blocks * block_size
    if num_keys > capacity:
        raise InvalidArgumentError(
            f"sequence {seq} reads {num_keys} keys, more than the caches hold "
            f"({num_blocks} blocks x block_size {block_size}); its table repeats blocks, which the "
            "NumPy reference (a contiguous copy per sequence) refuses"
        )


def paged_prefill_attention(
    q: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    seq_lens: object,
    query_start_loc: object,
    scale: float | None,
    causal: bool,
    window: int | None = None,
) -> np.ndarray:
    """With a sliding ``window`` (causal only) the query at position p sees keys
    max(0, p - window + 1)..p; only the blocks from the sequence's earliest visible key on are
    gathered (entries before them may be -1)."""
    args = pval.check_paged_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, causal, "numpy", window
    )
    shape = args.shape
    out = np.empty(args.q.shape, dtype=args.q.dtype)
    per_row = max(1, shape.num_q_heads)
    for b in range(shape.num_seqs):
        q0, q1 = int(args.query_start_loc[b]), int(args.query_start_loc[b + 1])
        if q1 == q0:
            continue
        seq_len = int(args.seq_lens[b])
        positions = np.arange(seq_len - (q1 - q0), seq_len, dtype=np.int64)
        first_keys = first_visible_key(positions, window)
        # Gather from the first block any row's window reaches; key positions below are relative
        # to that block's first token.
        base = int(first_keys[0]) // shape.block_size * shape.block_size
        check_within_cache(b, seq_len - base, shape.num_blocks, shape.block_size)
        start = int(args.table.row_start[b]) + base // shape.block_size
        blocks = args.table.indices[start : start + -(-(seq_len - base) // shape.block_size)]
        k = gather_rows(args.k_cache, blocks, seq_len - base, shape.kind)
        v = gather_rows(args.v_cache, blocks, seq_len - base, shape.kind)
        num_keys = positions + 1 if shape.causal else np.full(q1 - q0, seq_len, dtype=np.int64)
        chunk = max(1, MAX_SCORE_ELEMENTS // (per_row * max(1, seq_len - base)))
        for r0 in range(q0, q1, chunk):
            r1 = min(q1, r0 + chunk)
            rows = np.array(to_compute(args.q[r0:r1], shape.kind), order="C")
            lo, hi = r0 - q0, r1 - q0
            windowed = None if window is None else first_keys[lo:hi] - base
            result = attend_rows(rows, k, v, num_keys[lo:hi] - base, shape.scale, windowed)
            out[r0:r1] = from_compute(result, shape.kind, args.q.dtype)
    return out
