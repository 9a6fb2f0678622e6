"""Argument checks for calls on quantized caches (``QuantizedKvCache``); they run before anything
is read or written, so no input can make the reference or a kernel touch memory outside the
caches, or half-apply a write. Failures raise ``InvalidArgumentError``.

What a quantized call adds to the unquantized checks (``validation``, ``prefill_validation``):
the cache pair (one kv_cache_dtype and geometry, roles key and value, byte rows of the layout's
length, int4 residual arrays), and for int4 the residual slots: attention needs each sequence's
slot when its last block is open (``seq_len % block_size != 0``); a write needs every token's
slot where the token lands in, or seals, an open block (docs/quantized_kv.md, "Writes").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.attention import cache_op_validation as cval
from pagedkv.attention import prefill_validation as pval
from pagedkv.attention import validation as val
from pagedkv.attention.kv_cache_dtype import BlockLayout
from pagedkv.attention.quantized_cache import QuantizedKvCache
from pagedkv.errors import InvalidArgumentError

__all__ = [
    "SealPlan",
    "check_quant_copy",
    "check_quant_decode",
    "check_quant_pair",
    "check_quant_prefill",
    "check_quant_swap",
    "check_quant_write",
    "is_quantized",
    "plan_seals",
]


def is_quantized(*caches: Any) -> bool:
    """Whether any of ``caches`` (caches, or lists of per-layer caches) is a QuantizedKvCache."""
    for c in caches:
        if isinstance(c, QuantizedKvCache):
            return True
        if isinstance(c, (list, tuple)) and any(isinstance(x, QuantizedKvCache) for x in c):
            return True
    return False


@dataclass(frozen=True)
class QuantPair:
    """A validated key/value cache pair."""

    k: QuantizedKvCache
    v: QuantizedKvCache

    @property
    def kv_cache_dtype(self) -> str:
        return self.k.kv_cache_dtype

    @property
    def layouts(self) -> tuple[BlockLayout, BlockLayout]:
        return self.k.layout, self.v.layout


def _check_bytes(name: str, data: Any, layout: BlockLayout, backend: str) -> None:
    val._require_array(name, data, backend)
    if data.dtype != np.uint8 or data.ndim != 2 or int(data.shape[1]) != layout.block_bytes:
        raise InvalidArgumentError(
            f"{name} must be uint8 [num_blocks, {layout.block_bytes}] (the {layout.kv_cache_dtype} "
            f"{layout.role} layout), got {data.dtype} {tuple(data.shape)}"
        )
    val._require_contiguous(name, data)
    if backend != "numpy":
        val._require_aligned(name, data)


def check_quant_pair(k_cache: Any, v_cache: Any, backend: str, *, writable: bool = False) -> QuantPair:
    """Both caches QuantizedKvCache of one dtype and geometry, roles key then value, their byte
    arrays (and int4 residuals) well formed for ``backend``."""
    if not isinstance(k_cache, QuantizedKvCache) or not isinstance(v_cache, QuantizedKvCache):
        raise InvalidArgumentError(
            "k_cache and v_cache must both be QuantizedKvCache (or both plain arrays), got "
            f"{type(k_cache).__name__} and {type(v_cache).__name__}"
        )
    if k_cache.role != "key" or v_cache.role != "value":
        raise InvalidArgumentError(
            "k_cache must have role 'key' and v_cache role 'value', got "
            f"{k_cache.role!r} and {v_cache.role!r}"
        )
    geometry = ("kv_cache_dtype", "block_size", "num_kv_heads", "head_dim")
    for field in geometry:
        if getattr(k_cache, field) != getattr(v_cache, field):
            raise InvalidArgumentError(
                f"k_cache and v_cache differ in {field}: "
                f"{getattr(k_cache, field)!r} vs {getattr(v_cache, field)!r}"
            )
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_bytes(f"{name}.data", c.data, c.layout, backend)
        if writable:
            val._require_writable(f"{name}.data", c.data)
    if int(k_cache.data.shape[0]) != int(v_cache.data.shape[0]):
        raise InvalidArgumentError(
            f"k_cache has {int(k_cache.data.shape[0])} blocks, v_cache {int(v_cache.data.shape[0])}"
        )
    if k_cache.kv_cache_dtype == "int4":
        # The residual caches' own format and geometry were checked when they were built
        # (QuantizedKvCache.__post_init__); here their bytes, for this backend.
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            r = c.residual
            _check_bytes(f"{name}.residual.data", r.data, r.layout, backend)
            if writable:
                val._require_writable(f"{name}.residual.data", r.data)
        if k_cache.num_residual_slots != v_cache.num_residual_slots:
            raise InvalidArgumentError(
                f"k_cache has {k_cache.num_residual_slots} residual slots, v_cache "
                f"{v_cache.num_residual_slots}"
            )
    return QuantPair(k_cache, v_cache)


def _host_slots(name: str, slots: Any, length: int, backend: str) -> np.ndarray:
    slots = pval.host_int_array(name, slots, 1, backend)
    if int(slots.shape[0]) != length:
        raise InvalidArgumentError(f"{name} must have {length} entries, got {int(slots.shape[0])}")
    return slots


def check_sequence_residuals(
    pair: QuantPair, residual_slots: Any, seq_lens: np.ndarray, backend: str
) -> np.ndarray | None:
    """int4: each sequence's residual slot (int32 ``[num_seqs]``), which must name a slot where
    its last block is open (``seq_len % block_size != 0``; elsewhere it is never read and may be
    -1); the 8-bit dtypes take none. Returns the slots on the host (None for 8-bit)."""
    if pair.kv_cache_dtype != "int4":
        if residual_slots is not None:
            raise InvalidArgumentError(f"residual_slots is for int4 caches, not {pair.kv_cache_dtype}")
        return None
    if residual_slots is None:
        raise InvalidArgumentError("an int4 cache needs residual_slots (each sequence's residual slot)")
    slots = _host_slots("residual_slots", residual_slots, int(seq_lens.shape[0]), backend)
    open_block = seq_lens.astype(np.int64) % pair.k.block_size != 0
    bad = np.flatnonzero(open_block & ((slots < 0) | (slots >= pair.k.num_residual_slots)))
    if bad.size:
        b = int(bad[0])
        raise InvalidArgumentError(
            f"residual_slots[{b}] = {int(slots[b])} is not a residual slot in [0, "
            f"{pair.k.num_residual_slots}) and sequence {b}'s last block is open (seq_len {int(seq_lens[b])})"
        )
    return slots


def _check_q(q: Any, backend: str, ndim: int, what: str) -> str:
    val._require_array("q", q, backend)
    if q.ndim != ndim:
        raise InvalidArgumentError(f"q must be {what}, got shape {tuple(q.shape)}")
    val._require_contiguous("q", q)
    return val._kind("q", q, backend)


def _check_kernel_geometry(pair: QuantPair, group: int) -> None:
    val.check_kernel_sizes(pair.k.head_dim, pair.k.block_size, group)


def check_quant_decode(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    scale: Any,
    backend: str,
    window: int | None,
    residual_slots: Any,
) -> tuple[QuantPair, val.AttentionShape, np.ndarray | None, np.ndarray]:
    """A decode call on quantized caches: (the pair, the call's sizes, the residual slots and the
    lengths on the host). Tables and lengths are host (NumPy) arrays on every backend."""
    val.check_backend(backend)
    pair = check_quant_pair(k_cache, v_cache, backend)
    kind = _check_q(q, backend, 3, "[num_seqs, num_q_heads, head_dim]")
    num_seqs, num_q_heads, head_dim = (int(s) for s in q.shape)
    if head_dim != pair.k.head_dim:
        raise InvalidArgumentError(f"q head_dim {head_dim} != cache head_dim {pair.k.head_dim}")
    if num_q_heads < 1 or num_q_heads % pair.k.num_kv_heads:
        raise InvalidArgumentError(
            f"num_q_heads {num_q_heads} is not a positive multiple of num_kv_heads {pair.k.num_kv_heads}"
        )
    group = num_q_heads // pair.k.num_kv_heads
    if backend != "numpy":
        _check_kernel_geometry(pair, group)
        val._require_aligned("q", q)
        if num_seqs > 65535:
            raise InvalidArgumentError(f"at most 65535 sequences per launch, got {num_seqs}")
    tables = pval.host_int_array("block_tables", block_tables, 2, backend)
    lens = pval.host_int_array("seq_lens", seq_lens, 1, backend)
    if int(tables.shape[0]) != num_seqs or int(lens.shape[0]) != num_seqs:
        raise InvalidArgumentError(
            f"block_tables {tuple(tables.shape)} and seq_lens {tuple(lens.shape)} must have "
            f"num_seqs = {num_seqs} rows"
        )
    shape = val.AttentionShape(
        num_seqs,
        num_q_heads,
        pair.k.num_kv_heads,
        head_dim,
        pair.k.block_size,
        pair.k.num_blocks,
        int(tables.shape[1]),
        group,
        kind,
        val._scale(scale, head_dim),
    )
    max_seq_len = val.check_decode_metadata(tables, lens, shape, backend, window)
    slots = check_sequence_residuals(pair, residual_slots, lens, backend)
    return pair, dataclasses.replace(shape, max_seq_len=max_seq_len), slots, lens


def check_quant_prefill(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    scale: Any,
    causal: Any,
    backend: str,
    window: int | None,
    residual_slots: Any,
) -> tuple[QuantPair, pval.PrefillArgs, np.ndarray | None]:
    """A prefill call on quantized caches: the unquantized call's metadata checks against the
    caches' logical shape, plus the pair and the residual slots."""
    val.check_backend(backend)
    pval.check_causal(causal)
    pair = check_quant_pair(k_cache, v_cache, backend)
    q = pval.require_plain_array("q", q, backend)
    kind = _check_q(q, backend, 3, "[total_q, num_q_heads, head_dim]")
    args = pval.check_prefill_metadata(
        q,
        k_cache,
        v_cache,
        kind,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        causal,
        backend,
        window,
        [("q", q)],
    )
    if backend != "numpy":
        _check_kernel_geometry(pair, args.shape.group)
    slots = check_sequence_residuals(pair, residual_slots, args.seq_lens, backend)
    return pair, args, slots


@dataclass(frozen=True)
class SealPlan:
    """How an int4 write lands: blocks sealed (quantized whole) and tokens parked in residuals.

    seal_blocks int32 [S]: blocks that fill in this write; seal_residual int32 [S]: the residual
    slot holding each one's earlier tokens (-1: none, the write holds all of them); seal_rows int32
    [S, block_size]: the input row of each offset (-1: from the residual); residual_mapping int64
    [num_tokens]: ``slot * block_size + offset`` in the residual of each token whose block stays
    open, -1 for the others (sealed, or skipped)."""

    seal_blocks: np.ndarray
    seal_residual: np.ndarray
    seal_rows: np.ndarray
    residual_mapping: np.ndarray


def plan_seals(
    slot_mapping: np.ndarray, residual_slots: np.ndarray, block_size: int, num_residual_slots: int
) -> SealPlan:
    """Plans an int4 write and checks its contract (docs/quantized_kv.md, "Writes"): the tokens a
    write puts in one block are consecutive offsets of one sequence (one residual slot); a block
    they fill is sealed, its earlier offsets read from that residual slot; a block they leave open
    keeps them in it. Two blocks may not both read, or both park in, one slot."""
    num_tokens = int(slot_mapping.shape[0])
    rows = np.flatnonzero(slot_mapping >= 0)
    slots = slot_mapping[rows].astype(np.int64)
    blocks, offsets = slots // block_size, slots % block_size
    order = np.lexsort((offsets, blocks))
    rows, blocks, offsets = rows[order], blocks[order], offsets[order]
    res = residual_slots[rows].astype(np.int64)
    starts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]]) if rows.size else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], rows.size].astype(np.int64)
    run = ends - starts
    first_off, last_off = offsets[starts], offsets[ends - 1] if rows.size else offsets[starts]
    if np.any(last_off - first_off + 1 != run):
        b = int(blocks[starts[np.flatnonzero(last_off - first_off + 1 != run)[0]]])
        raise InvalidArgumentError(f"the tokens written to block {b} are not consecutive offsets")
    block_of_token = np.repeat(np.arange(starts.size), run)
    if np.any(res != res[starts][block_of_token]):
        b = int(blocks[np.flatnonzero(res != res[starts][block_of_token])[0]])
        raise InvalidArgumentError(f"the tokens written to block {b} name different residual slots")
    fills = last_off == block_size - 1
    reads = fills & (first_off > 0)
    parks = ~fills
    needs = reads | parks
    block_res = res[starts]
    bad = np.flatnonzero(needs & ((block_res < 0) | (block_res >= num_residual_slots)))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(
            f"block {int(blocks[starts[i]])} is open (or sealed from earlier tokens) and needs a residual "
            f"slot in [0, {num_residual_slots}), got {int(block_res[i])}"
        )
    for what, mask in (("read", reads), ("parked in", parks)):
        used = block_res[mask]
        if np.unique(used).size != used.size:
            raise InvalidArgumentError(f"two blocks of one write are {what} one residual slot")
    seal_idx = np.flatnonzero(fills)
    seal_rows = np.full((seal_idx.size, block_size), -1, dtype=np.int32)
    seal_of_block = np.full(starts.size, -1, dtype=np.int64)
    seal_of_block[seal_idx] = np.arange(seal_idx.size)
    seal_of_token = seal_of_block[block_of_token]
    sealed = seal_of_token >= 0
    seal_rows[seal_of_token[sealed], offsets[sealed]] = rows[sealed]
    residual_mapping = np.full(num_tokens, -1, dtype=np.int64)
    parked = parks[block_of_token]
    residual_mapping[rows[parked]] = res[parked] * block_size + offsets[parked]
    return SealPlan(
        blocks[starts[seal_idx]].astype(np.int32),
        np.where(reads[seal_idx], block_res[seal_idx], -1).astype(np.int32),
        seal_rows,
        residual_mapping,
    )


def check_quant_write(
    k: Any, v: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, backend: str, residual_slots: Any
) -> tuple[QuantPair, str, SealPlan | None, np.ndarray]:
    """A write_kv call on quantized caches: (pair, the k/v kind, the int4 plan or None, the slot
    mapping on the host). k, v: ``[num_tokens, num_kv_heads, head_dim]`` of one float dtype."""
    val.check_backend(backend)
    pair = check_quant_pair(k_cache, v_cache, backend, writable=True)
    want = (pair.k.num_kv_heads, pair.k.head_dim)
    kind = ""
    for name, x in (("k", k), ("v", v)):
        val._require_array(name, x, backend)
        if x.ndim != 3 or tuple(int(s) for s in x.shape[1:]) != want:
            raise InvalidArgumentError(
                f"{name} must be [num_tokens, {want[0]}, {want[1]}], got shape {tuple(x.shape)}"
            )
        val._require_contiguous(name, x)
        kind = val._kind(name, x, backend)
        if backend != "numpy":
            val._require_aligned(name, x)
    if tuple(v.shape) != tuple(k.shape) or v.dtype != k.dtype:
        raise InvalidArgumentError(
            f"k and v must have one shape and dtype, got {k.dtype} {tuple(k.shape)} and "
            f"{v.dtype} {tuple(v.shape)}"
        )
    num_tokens = int(k.shape[0])
    if num_tokens > 2**31 - 1:
        raise InvalidArgumentError("too many tokens for one launch")
    # Planning reads the mapping on the host: a CuPy one (backend='cuda') is copied there.
    mapping = slot_mapping.get() if backend == "cuda" and val.is_cupy_array(slot_mapping) else slot_mapping
    mapping = pval.require_plain_array("slot_mapping", mapping, "numpy")
    val._require_int("slot_mapping", mapping, np.int64, 1)
    if int(mapping.shape[0]) != num_tokens:
        raise InvalidArgumentError(
            f"slot_mapping has {int(mapping.shape[0])} entries for {num_tokens} tokens"
        )
    num_slots = pair.k.num_blocks * pair.k.block_size
    if num_tokens:
        if int(mapping.min()) < -1 or int(mapping.max()) >= num_slots:
            raise InvalidArgumentError(
                f"slot_mapping entries must lie in [-1, {num_slots}) (-1 skips a token)"
            )
        real = mapping[mapping >= 0]
        if np.unique(real).shape[0] != real.shape[0]:
            raise InvalidArgumentError("slot_mapping names one slot twice")
    if pair.kv_cache_dtype != "int4":
        if residual_slots is not None:
            raise InvalidArgumentError(f"residual_slots is for int4 caches, not {pair.kv_cache_dtype}")
        return pair, kind, None, mapping
    if residual_slots is None:
        raise InvalidArgumentError("an int4 write needs residual_slots (each token's residual slot)")
    slots = _host_slots("residual_slots", residual_slots, num_tokens, backend)
    plan = plan_seals(mapping, slots, pair.k.block_size, pair.k.num_residual_slots)
    return pair, kind, plan, mapping


def _check_layer_lists(k_caches: Any, v_caches: Any) -> None:
    if not isinstance(k_caches, (list, tuple)) or not isinstance(v_caches, (list, tuple)):
        raise InvalidArgumentError("k_caches and v_caches must be lists (one cache per layer)")
    if len(k_caches) == 0 or len(k_caches) != len(v_caches):
        raise InvalidArgumentError(
            f"k_caches ({len(k_caches)}) and v_caches ({len(v_caches)}) must list the same layers, "
            "at least one"
        )


def check_quant_copy(
    k_caches: Any, v_caches: Any, copy_ops: Any, backend: str
) -> tuple[list[QuantPair], np.ndarray]:
    """copy_blocks over quantized caches: every layer a valid pair of one geometry; copy_ops int32
    [N, 2] of block ids."""
    val.check_backend(backend)
    _check_layer_lists(k_caches, v_caches)
    pairs = [check_quant_pair(k, v, backend, writable=True) for k, v in zip(k_caches, v_caches, strict=True)]
    first = pairs[0].k
    for layer, p in enumerate(pairs):
        if (p.k.kv_cache_dtype, p.k.shape) != (first.kv_cache_dtype, first.shape):
            raise InvalidArgumentError(f"layer {layer}'s caches differ in dtype or shape from layer 0's")
    if len(pairs) > 65535:
        raise InvalidArgumentError("at most 65535 layers per launch")
    return pairs, cval.check_copy_ops(copy_ops, backend, first.num_blocks)


def check_quant_swap(src_cache: Any, dst_cache: Any, mapping: Any, backend: str) -> None:
    """swap_blocks between two quantized caches of one dtype, role and geometry: their byte arrays
    are checked as an unquantized swap checks its caches."""
    val.check_backend(backend)
    for name, c in (("src_cache", src_cache), ("dst_cache", dst_cache)):
        if not isinstance(c, QuantizedKvCache):
            raise InvalidArgumentError(
                f"{name} must be a QuantizedKvCache like the other, got {type(c).__name__}"
            )
    same = ("kv_cache_dtype", "role", "block_size", "num_kv_heads", "head_dim")
    for field in same:
        if getattr(src_cache, field) != getattr(dst_cache, field):
            raise InvalidArgumentError(
                f"src_cache and dst_cache differ in {field}: "
                f"{getattr(src_cache, field)!r} vs {getattr(dst_cache, field)!r}"
            )
    for name, c in (("src_cache", src_cache), ("dst_cache", dst_cache)):
        data = c.data
        ok = (val.is_cupy_array(data) or isinstance(data, np.ndarray)) and data.dtype == np.uint8
        if not ok or data.ndim != 2 or int(data.shape[1]) != c.layout.block_bytes:
            raise InvalidArgumentError(
                f"{name}.data must be uint8 [num_blocks, {c.layout.block_bytes}], got "
                f"{getattr(data, 'dtype', '?')} "
                f"{tuple(getattr(data, 'shape', ()))}"
            )
    cval.check_swap_bytes(src_cache.data, dst_cache.data, mapping, backend)
