"""The small float formats of the quantized KV caches, bit-exact with the kernels' ``kv_quant.h``.

- **fp8 e4m3** (OCP ``E4M3FN``, CUDA's ``__nv_fp8_e4m3``): 1 sign, 4 exponent (bias 7), 3 mantissa
  bits, no infinities, ``0x7F``/``0xFF`` NaN, largest finite 448. ``float32_to_e4m3`` rounds to
  nearest even and saturates exactly as CUDA's ``__nv_cvt_float_to_fp8(x, __NV_SATFINITE,
  __NV_E4M3)`` (the constructor of ``__nv_fp8_e4m3``): a magnitude above 464 (448 plus half an
  ulp; infinities included) becomes +-448, one at or below 2^-10 (half the smallest subnormal)
  becomes +-0, NaN becomes NaN (the sign bit kept, as CUDA's software path does).
- **UE5M3** (the 8-bit caches' scale, one per (token, head)): an unsigned byte ``b = e << 3 | m``
  (5 exponent bits, 3 mantissa bits, no subnormals) is ``(1 + m / 8) * 2^(e - 22)``, from 2^-22
  (byte 0) to 1.75 * 2^9 (0xFE); ``0xFF`` is NaN. Its float32 bits are ``(b << 20) + (105 << 23)``.
  The range covers every float16 row without clipping (docs/quantized_kv.md).
- **bfloat16 rounded toward +-infinity**: the int4 cache's side parameters (grid starts rounded
  down, steps rounded up, so a rounded grid still covers what it must).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "E4M3_MAX",
    "UE5M3_NAN",
    "bf16_bits_to_float32",
    "bf16_next_up",
    "bf16_round_down",
    "bf16_round_up",
    "e4m3_to_float32",
    "ue5m3_scale_for",
    "ue5m3_to_float32",
    "float32_to_e4m3",
]

E4M3_MAX = 448.0
UE5M3_NAN = 0xFF
UE5M3_MANTISSA_BITS = 3
UE5M3_BIAS = 22  # byte 0 is 2^-22; 0xFE is 1.75 * 2^9
UE5M3_LARGEST = 0xFE
_UE5M3_BASE = (127 - UE5M3_BIAS) << 23  # float32 bits of byte 0


def _e4m3_table() -> np.ndarray:
    """float32 value of every e4m3 byte, from the definition."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent.astype(np.float64) - 7.0)
    subnormal = mantissa / 8.0 * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


_E4M3_VALUES = _e4m3_table()


def e4m3_to_float32(codes: np.ndarray) -> np.ndarray:
    """uint8 e4m3 codes -> float32 values (exact)."""
    return _E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def float32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> uint8 e4m3 codes: round to nearest even, saturating (see the module docstring)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign = ((bits >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)
    absbits = bits & np.uint32(0x7FFFFFFF)
    exponent = (absbits >> np.uint32(23)).astype(np.int64) - 127  # unbiased fp32 exponent
    mantissa = (absbits & np.uint32(0x7FFFFF)).astype(np.int64)
    # Normal e4m3 (exponent >= -6): keep 3 of fp32's 23 mantissa bits, round the other 20.
    kept = mantissa >> 20
    rest = mantissa & ((1 << 20) - 1)
    up = (rest > (1 << 19)) | ((rest == (1 << 19)) & ((kept & 1) == 1))
    normal = ((exponent + 7) << 3 | kept) + up  # a carry into the exponent is the right rounding
    # Subnormal e4m3 (value = m * 2^-9, m in 0..7 and 8 meaning the smallest normal): round the
    # full significand (implicit bit included) shifted to units of 2^-9.
    significand = mantissa | (1 << 23)
    # value / 2^-9 = significand * 2^(exponent - 14): a right shift by 14 - exponent (>= 21 here;
    # capped where every significand bit is shifted out anyway).
    shift = np.minimum(14 - exponent, 40)
    m = significand >> shift
    frac = significand & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << np.maximum(shift - 1, 0)
    sub_up = (frac > half) | ((frac == half) & ((m & 1) == 1))
    subnormal = m + sub_up
    out = np.where(exponent >= -6, normal, subnormal)
    out = np.where(absbits > np.uint32(0x43E80000), 0x7E, out)  # above 464 (and +-inf): saturate to 448
    out = np.where(absbits <= np.uint32(0x3A800000), 0, out)  # at or below 2^-10: zero
    out = np.where(absbits > np.uint32(0x7F800000), 0x7F, out)  # NaN
    return (out.astype(np.uint8) | sign).astype(np.uint8)


def ue5m3_to_float32(scales: np.ndarray) -> np.ndarray:
    """uint8 UE5M3 bytes -> float32 ``(1 + m / 8) * 2^(e - 22)`` (exact); 0xFF -> NaN."""
    b = np.asarray(scales, dtype=np.uint8).astype(np.uint32)
    out = ((b << np.uint32(23 - UE5M3_MANTISSA_BITS)) + np.uint32(_UE5M3_BASE)).view(np.float32)
    return np.where(b == UE5M3_NAN, np.float32(np.nan), out).astype(np.float32)


def ue5m3_scale_for(amax: np.ndarray, max_code: float, power_of_two: bool = False) -> np.ndarray:
    """The UE5M3 byte of the smallest scale s with ``amax <= max_code * s`` (``amax`` float32,
    >= 0), clamped to [2^-22, 1.75 * 2^9] (a row beyond ``max_code * 1.75 * 2^9`` saturates); NaN
    or infinite amax gives 0xFF (NaN). ``max_code``: 127 (int8) or 448 (e4m3). ``power_of_two``:
    only the bytes with mantissa 0 (2^-22 .. 2^9), as e4m3 takes them (docs/quantized_kv.md).

    ``amax / max_code`` (float32, rounded to nearest) rounded up to the format is the candidate;
    the float32 rounding can leave it one step short, which the exact check ``max_code * s >=
    amax`` (a product of at most 11 significant bits) catches."""
    a = np.asarray(amax, dtype=np.float32)
    finite = np.isfinite(a)
    safe = np.where(finite, a, np.float32(0))
    t = (safe / np.float32(max_code)).astype(np.float32)
    rel = t.view(np.uint32).astype(np.int64) - _UE5M3_BASE
    shift = 23 - UE5M3_MANTISSA_BITS
    b = (rel >> shift) + ((rel & ((1 << shift) - 1)) != 0)
    step = 1 << UE5M3_MANTISSA_BITS if power_of_two else 1
    largest = UE5M3_LARGEST & ~(step - 1)  # 0xFE, or 0xF8 (2^9) for powers of two
    b = np.where(rel <= 0, 0, b)
    b = np.clip((b + step - 1) // step * step, 0, largest)
    short = np.float32(max_code) * ue5m3_to_float32(b.astype(np.uint8)) < safe
    b = np.where(short & (b < largest), b + step, b)
    return np.where(finite, b, UE5M3_NAN).astype(np.uint8)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _bf16_directed(x: np.ndarray, toward_positive: bool) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    high = (u >> np.uint32(16)).astype(np.uint32)
    inexact = (u & np.uint32(0xFFFF)) != 0
    negative = (u >> np.uint32(31)) == 1
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    # Away from zero on the side we round toward; truncation (toward zero) on the other.
    away = inexact & (negative != toward_positive)
    out = np.where(away, high + np.uint32(1), high)
    return np.where(is_nan, np.uint32(0x7FC0), out).astype(np.uint16)


def bf16_round_up(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits rounded toward +infinity (NaN -> quiet NaN)."""
    return _bf16_directed(x, toward_positive=True)


def bf16_round_down(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits rounded toward -infinity (NaN -> quiet NaN)."""
    return _bf16_directed(x, toward_positive=False)


def bf16_next_up(bits: np.ndarray) -> np.ndarray:
    """The next bfloat16 above a non-negative finite one (bits + 1)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) + np.uint32(1)).astype(np.uint16)
