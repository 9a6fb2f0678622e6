"""Builders shared by the quantized-cache tests: paged problems written through ``write_kv`` in
chunks (so int4 blocks are sealed from residual tokens, not only from one write), with every
byte of every unused block poisoned (0xFF decodes to NaN in every format: a UE5M3 scale of 0xFF,
bfloat16 side parameters 0xFFFF), the int8 residual slots' bytes too (NaN rows), so a stray
read shows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pagedkv.attention import QuantizedKvCache, write_kv
from pagedkv.attention.dtypes import float32_to_bf16_bits
from pagedkv.attention.quant_codec import decode_blocks

KIND_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "float64": np.float64}
POISON_BYTE = 0xFF


def to_kind(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bfloat16":
        return float32_to_bf16_bits(np.asarray(x, dtype=np.float32))
    return np.asarray(x).astype(KIND_DTYPES[kind])


def nan_of(kind: str) -> object:
    return 0x7FC0 if kind == "bfloat16" else np.nan


def empty_pair(
    dtype: str, kind: str, num_blocks: int, block_size: int, heads: int, dim: int, residual_slots: int
) -> tuple[QuantizedKvCache, QuantizedKvCache]:
    """A poisoned key/value pair (every block and residual byte 0xFF: NaN when read)."""
    caches = []
    for role in ("key", "value"):
        c = QuantizedKvCache.empty(
            dtype,
            role,
            num_blocks,
            block_size,
            heads,
            dim,
            num_residual_slots=residual_slots,
        )
        c.data[...] = POISON_BYTE
        if c.residual is not None:
            c.residual.data[...] = POISON_BYTE
        caches.append(c)
    return caches[0], caches[1]


@dataclass
class QuantProblem:
    k_cache: QuantizedKvCache
    v_cache: QuantizedKvCache
    block_tables: np.ndarray  # int32 [B, max_blocks], -1 padded
    seq_lens: np.ndarray  # int32 [B]
    residual_slots: np.ndarray | None  # int32 [B] (int4), slot b for sequence b
    keys: list[np.ndarray]  # per sequence [seq_len, heads, dim], the kind's dtype
    values: list[np.ndarray]
    kind: str


def chunk_bounds(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    """Random consecutive chunks covering [0, n): a prefill in pieces, then one-token decodes."""
    bounds, lo = [], 0
    while lo < n:
        step = 1 if lo > n * 3 // 4 else int(rng.integers(1, max(2, n // 2)))
        bounds.append((lo, min(n, lo + step)))
        lo += step
    return bounds


def write_sequences(
    p: QuantProblem, rng: np.random.Generator, backend: str, bounds: list[list[tuple[int, int]]]
) -> None:
    """Writes every sequence's keys and values through write_kv, chunk by chunk; the chunks of
    all sequences at the same step go in one call (a batch of several sequences)."""
    bs = p.k_cache.block_size
    steps = max(len(b) for b in bounds)
    for step in range(steps):
        ks, vs, slots, res = [], [], [], []
        for b, chunks in enumerate(bounds):
            if step >= len(chunks):
                continue
            lo, hi = chunks[step]
            pos = np.arange(lo, hi)
            slots.append(p.block_tables[b][pos // bs].astype(np.int64) * bs + pos % bs)
            ks.append(p.keys[b][lo:hi])
            vs.append(p.values[b][lo:hi])
            res.append(np.full(hi - lo, b, np.int32))
        if not ks:
            continue
        write_kv(
            np.ascontiguousarray(np.concatenate(ks)),
            np.ascontiguousarray(np.concatenate(vs)),
            p.k_cache,
            p.v_cache,
            np.concatenate(slots),
            backend=backend,
            residual_slots=np.concatenate(res) if p.residual_slots is not None else None,
        )


def make_problem(
    seed: int,
    dtype: str,
    kind: str,
    seq_lens: list[int],
    heads: int,
    dim: int,
    block_size: int,
    backend: str = "numpy",
    spare_blocks: int = 2,
    scale: float = 1.0,
) -> QuantProblem:
    """Sequences at random, non-contiguous block ids; table padding -1 or a poisoned spare block."""
    rng = np.random.default_rng(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    ids = rng.permutation(num_blocks).astype(np.int32)
    k_cache, v_cache = empty_pair(dtype, kind, num_blocks, block_size, heads, dim, len(seq_lens))
    max_blocks = max(needed, default=0) + 1
    tables = np.full((len(seq_lens), max_blocks), -1, dtype=np.int32)
    pos = 0
    for b in range(len(seq_lens)):
        tables[b, : needed[b]] = ids[pos : pos + needed[b]]
        pos += needed[b]
        if spare_blocks and b % 2:
            tables[b, needed[b] :] = ids[-1]
    keys = [to_kind(rng.standard_normal((n, heads, dim)) * scale, kind) for n in seq_lens]
    values = [to_kind(rng.standard_normal((n, heads, dim)) * scale, kind) for n in seq_lens]
    slots = np.arange(len(seq_lens), dtype=np.int32) if dtype == "int4" else None
    p = QuantProblem(k_cache, v_cache, tables, np.array(seq_lens, np.int32), slots, keys, values, kind)
    write_sequences(p, rng, backend, [chunk_bounds(rng, n) for n in seq_lens])
    return p


def dequantized_history(p: QuantProblem, cache: QuantizedKvCache, b: int) -> np.ndarray:
    """Sequence b's keys or values as the cache holds them (float32 [seq_len, heads, dim])."""
    n, bs = int(p.seq_lens[b]), cache.block_size
    sealed = n if cache.kv_cache_dtype != "int4" else n // bs * bs
    nb = -(-sealed // bs)
    out = np.empty((n, cache.num_kv_heads, cache.head_dim), np.float32)
    if nb:
        out[:sealed] = decode_blocks(cache.data[p.block_tables[b, :nb]], cache.layout).reshape(
            -1, *out.shape[1:]
        )[:sealed]
    if sealed < n:
        assert p.residual_slots is not None
        slot = int(p.residual_slots[b])
        res = cache.residual
        out[sealed:] = decode_blocks(res.data[slot : slot + 1], res.layout)[0, : n - sealed]
    return out


def dequantized_cache(p: QuantProblem) -> tuple[np.ndarray, np.ndarray]:
    """An fp32 ``[num_blocks, block_size, heads, dim]`` cache pair holding exactly the values the
    quantized pair decodes to, at the same slots (NaN elsewhere)."""
    bs = p.k_cache.block_size
    shape = (p.k_cache.num_blocks, bs, p.k_cache.num_kv_heads, p.k_cache.head_dim)
    out = []
    for cache in (p.k_cache, p.v_cache):
        flat = np.full(shape, np.nan, np.float32)
        for b, n in enumerate(p.seq_lens.tolist()):
            hist = dequantized_history(p, cache, b)
            pos = np.arange(n)
            flat[p.block_tables[b][pos // bs], pos % bs] = hist
        out.append(flat)
    return out[0], out[1]
