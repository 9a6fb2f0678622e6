"""Quantize and dequantize the KV formats (NumPy): the definition the kernels reproduce bit for bit.

Every step is float32 arithmetic in a fixed order, and every product whose rounding could depend
on a compiler fusing it into an FMA is exact by construction (a 4- or 8-bit integer times a
value of at most 11 significant bits), so the kernels (``kernels/kv_quant.h``) compute the very
same codes and the very same dequantized values. docs/quantized_kv.md states the formats and
the error bounds the tests prove.

8-bit (``int8``, ``fp8_e4m3``), per (token, head) of ``head_dim`` values with absolute maximum
``a``: the scale is the UE5M3 byte (4 significant bits) of the smallest ``s`` with ``a <= M * s``
(M = 127 for int8, 448 for e4m3; e4m3 only the powers of two among the bytes); int8 codes
are ``rint(x / s)`` (half to even), e4m3 codes are ``x / s`` converted with round-to-nearest-even,
``x / s`` being one correctly rounded float32 division (exact for e4m3's powers of two).
``code * s`` is exact (at most 7 + 4 significant bits), so the dequantized value is ``code * s``
exactly.

int4 (KIVI-style), for a *set* of *groups* of values that share side parameters: keys of one
(block, head): a group per channel, over the block's tokens; values of one (block, head): a group
per token, over its channels. Per group: center ``c = min/2 + max/2``; per set a bfloat16 center
grid ``lo + j * cstep`` (j in 0..15) with ``lo`` rounded down and ``cstep`` up; the group's
center code ``j``, its quantized center ``chat = lo + j * cstep`` and the half-range it needs
``r = max(max - chat, chat - min)``; per set a bfloat16 unit ``H`` rounded up so that ``15 * H``
covers every ``r``; per group the smallest ladder level ``L[k] = m[k % 4] / 2^(k // 4)``
(m = 1, 7/8, 3/4, 5/8) with ``15 * L[k] * H >= r`` gives the half step ``h = L[k] * H``; codes
``q = rint((x - chat) / (2h) + 7.5)`` in 0..15 decode to ``chat + (2q - 15) * h``. One metadata
byte per group: ``j << 4 | k``; three bfloat16 per set: ``lo, cstep, H``. A set holding a NaN or
an infinity stores NaN side parameters: all of it decodes to NaN.
"""

from __future__ import annotations

import numpy as np

from pagedkv.attention.kv_cache_dtype import BlockLayout
from pagedkv.attention.small_floats import (
    E4M3_MAX,
    bf16_bits_to_float32,
    bf16_next_up,
    bf16_round_down,
    bf16_round_up,
    e4m3_to_float32,
    float32_to_e4m3,
    ue5m3_scale_for,
    ue5m3_to_float32,
)

__all__ = [
    "INT4_LEVELS",
    "decode_blocks",
    "dequantize_8bit",
    "encode_blocks",
    "int4_decode",
    "int4_encode",
    "quantize_8bit",
    "round_trip_8bit",
]

F32 = np.float32
INT8_MAX = 127
# The half-step ladder: 16 levels, 3 significant bits each (so L[k] * H is exact).
INT4_LEVELS = np.array([m / 2.0**e for e in range(4) for m in (1.0, 0.875, 0.75, 0.625)], dtype=F32)
BF16_NAN = 0x7FC0


def quantize_8bit(x: np.ndarray, kv_cache_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``x [..., head_dim]`` -> (codes uint8 ``[..., head_dim]``, UE5M3 scales uint8
    ``[...]``): one scale per row (a token's head)."""
    x = np.asarray(x, dtype=F32)
    with np.errstate(invalid="ignore"):
        amax = np.abs(x).max(axis=-1) if x.shape[-1] else np.zeros(x.shape[:-1], F32)
    int8 = kv_cache_dtype == "int8"
    # e4m3 takes power-of-two scales only: x / s is then exact (docs/quantized_kv.md, "8-bit").
    scales = ue5m3_scale_for(amax, INT8_MAX if int8 else E4M3_MAX, power_of_two=not int8)
    finite = scales != 0xFF
    divisor = np.where(finite, ue5m3_to_float32(scales), F32(1))
    scaled = (np.where(finite[..., None], x, F32(0)) / divisor[..., None]).astype(F32)
    if kv_cache_dtype == "int8":
        codes = np.clip(np.rint(scaled), -INT8_MAX, INT8_MAX).astype(np.int8).view(np.uint8)
    else:
        codes = float32_to_e4m3(scaled)
    return np.where(finite[..., None], codes, np.uint8(0)).astype(np.uint8), scales


def dequantize_8bit(codes: np.ndarray, scales: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """(codes ``[..., head_dim]``, UE5M3 scales ``[...]``) -> float32 values, ``code * scale``
    (exact)."""
    codes = np.asarray(codes, dtype=np.uint8)
    if kv_cache_dtype == "int8":
        values = codes.view(np.int8).astype(F32)
    else:
        values = e4m3_to_float32(codes)
    return values * ue5m3_to_float32(scales)[..., None]


def round_trip_8bit(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """float32 ``x [..., head_dim]`` -> the float32 values an 8-bit cache stores for it (each row
    quantized with its own scale, then dequantized): what an int4 residual slot holds."""
    return dequantize_8bit(*quantize_8bit(x, kv_cache_dtype), kv_cache_dtype).astype(F32)


def int4_encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 ``x [sets, groups, n]`` -> (codes uint8 ``[sets, groups, n]`` in 0..15, group bytes
    uint8 ``[sets, groups]``, bfloat16 side parameters uint16 ``[sets, 3]``): see the module
    docstring."""
    x = np.asarray(x, dtype=F32)
    sets, groups, _ = x.shape
    finite = np.isfinite(x).all(axis=(1, 2))  # [sets]
    xs = np.where(finite[:, None, None], x, F32(0))
    mn, mx = xs.min(axis=2), xs.max(axis=2)  # [sets, groups]
    center = mn * F32(0.5) + mx * F32(0.5)
    lo_bits = bf16_round_down(center.min(axis=1))
    lo = bf16_bits_to_float32(lo_bits)
    cstep_bits = bf16_round_up((center.max(axis=1) - lo) / F32(15))
    cstep = bf16_bits_to_float32(cstep_bits)
    with np.errstate(invalid="ignore", divide="ignore"):
        j = np.where(
            cstep[:, None] > 0,
            np.clip(np.rint((center - lo[:, None]) / cstep[:, None]), 0, 15),
            F32(0),
        ).astype(F32)
    chat = lo[:, None] + j * cstep[:, None]  # the product is exact: one rounding, at the add
    need = np.maximum(mx - chat, chat - mn)
    rmax = need.max(axis=1)
    unit_bits = bf16_round_up(rmax / F32(15))
    for _ in range(2):  # rmax / 15 was rounded: make sure 15 * H covers rmax
        short = F32(15) * bf16_bits_to_float32(unit_bits) < rmax
        unit_bits = np.where(short, bf16_next_up(unit_bits), unit_bits)
    unit = bf16_bits_to_float32(unit_bits)
    covers = F32(15) * (INT4_LEVELS[None, None, :] * unit[:, None, None]) >= need[:, :, None]
    k = np.where(covers, np.arange(16), 0).max(axis=2)  # the smallest level that covers
    half = INT4_LEVELS[k] * unit[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        t = (xs - chat[:, :, None]) / (half + half)[:, :, None] + F32(7.5)
        codes = np.where(half[:, :, None] > 0, np.clip(np.rint(t), 0, 15), F32(8))
    meta = (j.astype(np.uint8) << np.uint8(4)) | k.astype(np.uint8)
    side = np.stack([lo_bits, cstep_bits, unit_bits], axis=1)
    codes = np.where(finite[:, None, None], codes, F32(0)).astype(np.uint8)
    meta = np.where(finite[:, None], meta, np.uint8(0)).astype(np.uint8)
    side = np.where(finite[:, None], side, np.uint16(BF16_NAN)).astype(np.uint16)
    return codes, meta, side


def int4_group_params(meta: np.ndarray, side: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(quantized centers, half steps) float32 ``[sets, groups]`` from group bytes ``[sets,
    groups]`` and side parameters ``[sets, 3]``."""
    meta = np.asarray(meta, dtype=np.uint8)
    side = bf16_bits_to_float32(side)
    j = (meta >> np.uint8(4)).astype(F32)
    k = (meta & np.uint8(0xF)).astype(np.int64)
    chat = side[:, 0, None] + j * side[:, 1, None]
    return chat, INT4_LEVELS[k] * side[:, 2, None]


def int4_decode(codes: np.ndarray, meta: np.ndarray, side: np.ndarray) -> np.ndarray:
    """Codes ``[sets, groups, n]`` (0..15), group bytes ``[sets, groups]``, side ``[sets, 3]`` ->
    float32 ``[sets, groups, n]``: ``chat + (2q - 15) * h`` (the product is exact)."""
    chat, half = int4_group_params(meta, side)
    odd = F32(2) * np.asarray(codes, dtype=F32) - F32(15)
    return chat[:, :, None] + odd * half[:, :, None]


def _views(data: np.ndarray, layout: BlockLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Views (no copies) of a ``[num_blocks, block_bytes]`` uint8 array: codes, metadata, side."""
    nb, bs, heads, dim = data.shape[0], layout.block_size, layout.num_kv_heads, layout.head_dim
    width = dim // 2 if layout.kv_cache_dtype == "int4" else dim
    codes = data[:, : layout.codes_bytes].reshape(nb, bs, heads, width)
    meta_2d = data[:, layout.meta_offset : layout.meta_offset + layout.meta_bytes]
    per_channel = layout.kv_cache_dtype == "int4" and layout.role == "key"
    meta = meta_2d.reshape((nb, heads, dim) if per_channel else (nb, bs, heads))
    side = None
    if layout.side_bytes:
        side = (
            data[:, layout.side_offset : layout.side_offset + layout.side_bytes]
            .view(np.uint16)
            .reshape(nb, heads, 3)
        )
    return codes, meta, side


def _sets(x: np.ndarray, role: str) -> np.ndarray:
    """``[nb, bs, heads, dim]`` -> the int4 sets ``[nb * heads, groups, n]`` of a role."""
    nb, bs, heads, dim = x.shape
    if role == "key":  # a group per channel, over the block's tokens
        return np.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(nb * heads, dim, bs)
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(nb * heads, bs, dim)  # per token


def _unsets(y: np.ndarray, role: str, nb: int, bs: int, heads: int, dim: int) -> np.ndarray:
    """Inverse of ``_sets``."""
    if role == "key":
        return y.reshape(nb, heads, dim, bs).transpose(0, 3, 1, 2)
    return y.reshape(nb, heads, bs, dim).transpose(0, 2, 1, 3)


def encode_blocks(x: np.ndarray, layout: BlockLayout) -> np.ndarray:
    """float32 ``[nb, block_size, num_kv_heads, head_dim]`` (whole blocks) -> their bytes
    ``[nb, block_bytes]`` (padding zero)."""
    x = np.asarray(x, dtype=F32)
    nb, bs, heads, dim = x.shape
    out = np.zeros((nb, layout.block_bytes), dtype=np.uint8)
    codes_v, meta_v, side_v = _views(out, layout)
    if layout.kv_cache_dtype != "int4":
        codes, scales = quantize_8bit(x, layout.kv_cache_dtype)
        codes_v[...] = codes
        meta_v[...] = scales
        return out
    codes, meta, side = int4_encode(_sets(x, layout.role))
    q = _unsets(codes, layout.role, nb, bs, heads, dim)  # [nb, bs, heads, dim]
    codes_v[...] = q[..., 0::2] | (q[..., 1::2] << np.uint8(4))
    meta_v[...] = (
        meta.reshape(nb, heads, -1)
        if layout.role == "key"
        else meta.reshape(nb, heads, bs).transpose(0, 2, 1)
    )
    assert side_v is not None
    side_v[...] = side.reshape(nb, heads, 3)
    return out


def decode_blocks(data: np.ndarray, layout: BlockLayout) -> np.ndarray:
    """Bytes ``[nb, block_bytes]`` -> float32 ``[nb, block_size, num_kv_heads, head_dim]``: every
    token of every block, as the kernels dequantize it."""
    nb, bs, heads, dim = data.shape[0], layout.block_size, layout.num_kv_heads, layout.head_dim
    codes_v, meta_v, side_v = _views(data, layout)
    if layout.kv_cache_dtype != "int4":
        return dequantize_8bit(codes_v, meta_v, layout.kv_cache_dtype)
    q = np.empty((nb, bs, heads, dim), dtype=np.uint8)
    q[..., 0::2] = codes_v & np.uint8(0xF)
    q[..., 1::2] = codes_v >> np.uint8(4)
    meta = (
        meta_v.reshape(nb * heads, dim)
        if layout.role == "key"
        else meta_v.transpose(0, 2, 1).reshape(nb * heads, bs)
    )
    assert side_v is not None
    y = int4_decode(_sets(q, layout.role), meta, side_v.reshape(nb * heads, 3))
    return _unsets(y, layout.role, nb, bs, heads, dim)


def write_tokens_8bit(
    data: np.ndarray, layout: BlockLayout, x: np.ndarray, blocks: np.ndarray, offsets: np.ndarray
) -> None:
    """Quantizes float32 tokens ``x [n, num_kv_heads, head_dim]`` into slots (``blocks[i]``,
    ``offsets[i]``) of an 8-bit cache, in place."""
    codes_v, meta_v, _ = _views(data, layout)
    codes, scales = quantize_8bit(x, layout.kv_cache_dtype)
    codes_v[blocks, offsets] = codes
    meta_v[blocks, offsets] = scales
