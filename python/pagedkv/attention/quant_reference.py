"""NumPy reference of the data plane on quantized caches (``QuantizedKvCache``, ``backend="numpy"``).

Attention dequantizes exactly the keys and values a call reads (``quant_codec.decode_blocks`` for
sealed blocks, and for an int4 sequence's open last block its 8-bit residual slot) into a
contiguous copy and runs the unquantized reference's own ``attend`` / ``attend_rows`` on it. So
attention on a quantized cache equals, bit for bit, the unquantized reference on a cache holding
the dequantized values: the error a quantized cache adds is the codec's, which
docs/quantized_kv.md bounds.

Writes quantize on the way in: 8-bit caches quantize each token's heads into its slot; int4
caches park the tokens of a block that stays open in its residual slot (quantized to int8) and
seal a block that fills (its tokens' int8 values, read from the slot or round-tripped for the
new ones, quantized to int4 as a whole; ``quant_validation.plan_seals``), so a sealed block is
the same whichever write brought its tokens.
"""

from __future__ import annotations

import numpy as np

from pagedkv.attention import copy_planning, prefill_reference, reference
from pagedkv.attention import quant_validation as qval
from pagedkv.attention.dtypes import compute_dtype, from_compute, to_compute
from pagedkv.attention.prefill_reference import attend_rows, check_within_cache
from pagedkv.attention.quant_codec import (
    decode_blocks,
    encode_blocks,
    round_trip_8bit,
    write_tokens_8bit,
)
from pagedkv.attention.quantized_cache import QuantizedKvCache
from pagedkv.attention.window import first_visible_key

__all__ = [
    "copy_blocks",
    "gather_dequantized",
    "paged_attention",
    "paged_prefill_attention",
    "swap_blocks",
    "write_kv",
]


def gather_dequantized(
    cache: QuantizedKvCache,
    blocks: np.ndarray,
    seq_len: int,
    residual_slot: int,
    kind: str,
    start: int = 0,
) -> np.ndarray:
    """Positions ``start .. seq_len - 1`` of one sequence ``[seq_len - start, num_kv_heads,
    head_dim]`` in the accumulation type of ``kind``: sealed blocks dequantized, an int4 open last
    block read from ``residual_slot``. ``blocks``: the sequence's block ids (logical block i is
    ``blocks[i]``); the ones before ``start``'s block are never read."""
    bs = cache.block_size
    out = np.empty((seq_len - start, cache.num_kv_heads, cache.head_dim), dtype=compute_dtype(kind))
    sealed_end = seq_len if cache.kv_cache_dtype != "int4" else seq_len // bs * bs
    read = list(range(start // bs, -(-sealed_end // bs)))  # blocks holding tokens of [start, sealed_end)
    if read:
        decoded = decode_blocks(cache.data[np.asarray([int(blocks[i]) for i in read])], cache.layout)
        for n, i in enumerate(read):
            lo, hi = max(start, i * bs), min(sealed_end, (i + 1) * bs)
            out[lo - start : hi - start] = decoded[n, lo - i * bs : hi - i * bs]
    if sealed_end < seq_len:  # int4: the open block, in the residual (int8)
        lo = max(start, sealed_end)
        res = cache.residual
        open_block = decode_blocks(res.data[residual_slot : residual_slot + 1], res.layout)[0]
        out[lo - start :] = open_block[lo - sealed_end : seq_len - sealed_end]
    return out


def paged_attention(
    q: np.ndarray,
    k_cache: QuantizedKvCache,
    v_cache: QuantizedKvCache,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float | None,
    window: int | None,
    residual_slots: np.ndarray | None,
) -> np.ndarray:
    pair, shape, slots, lens = qval.check_quant_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale, "numpy", window, residual_slots
    )
    out = np.empty(q.shape, dtype=q.dtype)
    for b in range(shape.num_seqs):
        n = int(lens[b])
        start = 0 if window is None else max(0, n - window)
        check_within_cache(b, n - start, shape.num_blocks, shape.block_size)
        slot = -1 if slots is None else int(slots[b])
        k = gather_dequantized(pair.k, block_tables[b], n, slot, shape.kind, start)
        v = gather_dequantized(pair.v, block_tables[b], n, slot, shape.kind, start)
        qb = np.array(to_compute(q[b], shape.kind), order="C")
        out[b] = from_compute(reference.attend(qb, k, v, shape.scale), shape.kind, q.dtype)
    return out


def paged_prefill_attention(
    q: np.ndarray,
    k_cache: QuantizedKvCache,
    v_cache: QuantizedKvCache,
    block_tables: object,
    seq_lens: object,
    query_start_loc: object,
    scale: float | None,
    causal: bool,
    window: int | None,
    residual_slots: np.ndarray | None,
) -> np.ndarray:
    pair, args, slots = qval.check_quant_prefill(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        causal,
        "numpy",
        window,
        residual_slots,
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
        base = int(first_keys[0]) // shape.block_size * shape.block_size
        check_within_cache(b, seq_len - base, shape.num_blocks, shape.block_size)
        row = args.table.indices[int(args.table.row_start[b]) :]
        slot = -1 if slots is None else int(slots[b])
        k = gather_dequantized(pair.k, row, seq_len, slot, shape.kind, base)
        v = gather_dequantized(pair.v, row, seq_len, slot, shape.kind, base)
        num_keys = positions + 1 if shape.causal else np.full(q1 - q0, seq_len, dtype=np.int64)
        chunk = max(1, prefill_reference.MAX_SCORE_ELEMENTS // (per_row * max(1, seq_len - base)))
        for r0 in range(q0, q1, chunk):
            r1 = min(q1, r0 + chunk)
            rows = np.array(to_compute(args.q[r0:r1], shape.kind), order="C")
            lo, hi = r0 - q0, r1 - q0
            windowed = None if window is None else first_keys[lo:hi] - base
            result = attend_rows(rows, k, v, num_keys[lo:hi] - base, shape.scale, windowed)
            out[r0:r1] = from_compute(result, shape.kind, args.q.dtype)
    return out


def _seal_rows(
    x: np.ndarray, residual: QuantizedKvCache, plan: qval.SealPlan, i: int, kind: str
) -> np.ndarray:
    """The float32 tokens of sealed block ``plan.seal_blocks[i]``, each as its int8 residual row
    holds it: the residual slot's rows, then the new rows round-tripped through int8."""
    rows = plan.seal_rows[i]
    out = np.empty((rows.shape[0], *x.shape[1:]), dtype=np.float32)
    from_residual = rows < 0
    if from_residual.any():
        slot = int(plan.seal_residual[i])
        out[from_residual] = decode_blocks(residual.data[slot : slot + 1], residual.layout)[0][from_residual]
    new = to_compute(x[rows[~from_residual]], kind).astype(np.float32)
    out[~from_residual] = round_trip_8bit(new, residual.kv_cache_dtype)
    return out


def write_kv(
    k: np.ndarray,
    v: np.ndarray,
    k_cache: QuantizedKvCache,
    v_cache: QuantizedKvCache,
    slot_mapping: np.ndarray,
    residual_slots: np.ndarray | None,
) -> None:
    pair, kind, plan, mapping = qval.check_quant_write(
        k, v, k_cache, v_cache, slot_mapping, "numpy", residual_slots
    )
    bs = pair.k.block_size
    if plan is None:  # 8-bit: every token quantized into its slot
        keep = mapping >= 0
        blocks, offsets = mapping[keep] // bs, mapping[keep] % bs
        for x, cache in ((k, pair.k), (v, pair.v)):
            write_tokens_8bit(
                cache.data, cache.layout, to_compute(x[keep], kind).astype(np.float32), blocks, offsets
            )
        return
    # int4: seal the blocks that fill (they read the residual), then park the open ones' tokens.
    for x, cache in ((k, pair.k), (v, pair.v)):
        if plan.seal_blocks.size:
            tokens = np.stack(
                [_seal_rows(x, cache.residual, plan, i, kind) for i in range(plan.seal_blocks.size)]
            )
            cache.data[plan.seal_blocks] = encode_blocks(tokens, cache.layout)
        parked = plan.residual_mapping >= 0
        if parked.any():
            res, at = cache.residual, plan.residual_mapping[parked]
            new = to_compute(x[parked], kind).astype(np.float32)
            write_tokens_8bit(res.data, res.layout, new, at // bs, at % bs)


def copy_blocks(
    k_caches: list[QuantizedKvCache], v_caches: list[QuantizedKvCache], copy_ops: np.ndarray
) -> None:
    """Each (src, dst) block's bytes, codes and scales, in every layer; residuals are per sequence
    and not touched (copy a forked sequence's residual slot with copy_blocks on the residual
    caches)."""
    _, ops = qval.check_quant_copy(k_caches, v_caches, copy_ops, "numpy")
    for src, dst in ops.tolist():
        for cache in (*k_caches, *v_caches):
            cache.data[dst] = cache.data[src]


def swap_blocks(src_cache: QuantizedKvCache, dst_cache: QuantizedKvCache, mapping: np.ndarray) -> int:
    qval.check_quant_swap(src_cache, dst_cache, mapping, "numpy")
    runs = copy_planning.merge_runs(mapping)
    for src, dst, count in runs:
        dst_cache.data[dst : dst + count] = src_cache.data[src : src + count]
    return len(runs)
