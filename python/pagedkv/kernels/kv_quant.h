// The quantized KV formats on the device: the small floats, dequantization of one element of a
// block, and the per-format traits the quantized kernels are templated on.
//
// The definition is python/pagedkv/attention/quant_codec.py (docs/quantized_kv.md); every function
// here computes bit for bit what its NumPy twin computes. Products that a compiler may fuse into an
// FMA are exact by construction (small integer times a value of few significant bits), so fusing
// never changes a result. Blocks are byte rows; the byte offsets of their parts (codes, metadata,
// side parameters) come from the Python layout (kv_cache_dtype.block_layout) as kernel arguments.
#pragma once

#include "kv_types.h"

namespace pagedkv {

__device__ __forceinline__ bool is_finite_float(float x) {
  return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

__device__ __forceinline__ float quiet_nan() { return __uint_as_float(0x7fc00000u); }

// ---- UE5M3 scales: byte b = e << 3 | m is (1 + m / 8) * 2^(e - 22), 0xFF is NaN. ----

constexpr unsigned int kUe5m3Base = (127u - 22u) << 23;  // float32 bits of byte 0 (2^-22)
constexpr unsigned int kUe5m3Largest = 0xfeu;            // 1.75 * 2^9

__device__ __forceinline__ float ue5m3_to_float(unsigned int b) {
  if (b == 0xffu) return quiet_nan();
  return __uint_as_float((b << 20) + kUe5m3Base);
}

// The byte of the smallest scale s with amax <= kMaxCode * s, clamped to 2^-22 .. 1.75 * 2^9 (a
// larger row saturates); 0xFF when the row held a NaN or an infinity (`bad`). amax / kMaxCode
// (rounded to nearest) rounded up to the format is the candidate; the exact check (kMaxCode * s
// has at most 11 significant bits) adds the one step its rounding can miss.
// kPowerOfTwo: only the bytes with mantissa 0 (2^-22 .. 2^9), as e4m3 takes them.
template <int kMaxCode, bool kPowerOfTwo>
__device__ __forceinline__ unsigned int ue5m3_scale_for(float amax, bool bad) {
  if (bad) return 0xffu;
  constexpr unsigned int kStep = kPowerOfTwo ? 8u : 1u;
  constexpr unsigned int kLargest = kUe5m3Largest & ~(kStep - 1u);
  const unsigned int t = __float_as_uint(__fdiv_rn(amax, static_cast<float>(kMaxCode)));
  unsigned int b = 0u;
  if (t > kUe5m3Base) {
    const unsigned int rel = t - kUe5m3Base;
    b = (rel >> 20) + ((rel & 0xfffffu) != 0u ? 1u : 0u);
  }
  b = (b + kStep - 1u) / kStep * kStep;
  b = b < kLargest ? b : kLargest;
  if (static_cast<float>(kMaxCode) * ue5m3_to_float(b) < amax && b < kLargest) b += kStep;
  return b;
}

// ---- fp8 e4m3 (CUDA's __nv_fp8_e4m3: round to nearest even, saturating to +-448). ----

__device__ __forceinline__ unsigned int float_to_e4m3(float x) {
  const unsigned int bits = __float_as_uint(x);
  const unsigned int sign = (bits >> 24) & 0x80u;
  const unsigned int a = bits & 0x7fffffffu;
  unsigned int out;
  if (a > 0x7f800000u) {
    out = 0x7fu;  // NaN
  } else if (a > 0x43e80000u) {
    out = 0x7eu;  // above 464 (448 + half an ulp), infinities too: 448
  } else if (a <= 0x3a800000u) {
    out = 0u;  // at most 2^-10 (half the smallest subnormal): zero
  } else {
    const int exponent = static_cast<int>(a >> 23) - 127;
    const unsigned int mantissa = a & 0x7fffffu;
    if (exponent >= -6) {  // normal: keep 3 mantissa bits, round the other 20 (a carry is right)
      const unsigned int kept = mantissa >> 20;
      const unsigned int rest = mantissa & 0xfffffu;
      const unsigned int up = (rest > 0x80000u || (rest == 0x80000u && (kept & 1u))) ? 1u : 0u;
      out = ((static_cast<unsigned int>(exponent + 7) << 3) | kept) + up;
    } else {  // subnormal: units of 2^-9; exponent is -10..-7, so the shift is 21..24
      const unsigned int significand = mantissa | 0x800000u;
      const int shift = 14 - exponent;
      const unsigned int m = significand >> shift;
      const unsigned int frac = significand & ((1u << shift) - 1u);
      const unsigned int half = 1u << (shift - 1);
      out = m + ((frac > half || (frac == half && (m & 1u))) ? 1u : 0u);
    }
  }
  return out | sign;
}

__device__ __forceinline__ float e4m3_to_float(unsigned int c) {
  const unsigned int a = c & 0x7fu;
  float v;
  if (a == 0x7fu) {
    v = quiet_nan();
  } else if (a < 8u) {
    v = static_cast<float>(a) * 0.001953125f;  // subnormal: m * 2^-9, exact
  } else {
    v = __uint_as_float((((a >> 3) + 120u) << 23) | ((a & 7u) << 20));
  }
  return (c & 0x80u) ? -v : v;
}

// ---- bfloat16 rounded toward +-infinity (int4 side parameters). ----

__device__ __forceinline__ unsigned int bf16_directed(float x, bool toward_positive) {
  const unsigned int u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  const unsigned int high = u >> 16;
  const bool inexact = (u & 0xffffu) != 0u;
  const bool negative = (u >> 31) != 0u;
  return (inexact && negative != toward_positive) ? high + 1u : high;
}

__device__ __forceinline__ unsigned int bf16_round_up(float x) { return bf16_directed(x, true); }
__device__ __forceinline__ unsigned int bf16_round_down(float x) { return bf16_directed(x, false); }

// The int4 half-step ladder: L[k] = m[k % 4] / 2^(k / 4), m = 1, 7/8, 3/4, 5/8.
__device__ __forceinline__ float int4_level(unsigned int k) {
  const unsigned int r = k & 3u;
  const float m = r == 0u ? 1.f : (r == 1u ? 0.875f : (r == 2u ? 0.75f : 0.625f));
  return m * __uint_as_float((127u - (k >> 2)) << 23);
}

__device__ __forceinline__ unsigned int load_byte(const unsigned char* p) { return load_scalar(p); }

// A bfloat16 stored as two bytes (little-endian) of a block.
__device__ __forceinline__ float load_bf16_bytes(const unsigned char* p) {
  return bf16_bits_to_float(static_cast<unsigned short>(load_byte(p) | (load_byte(p + 1) << 8)));
}

// ---- Format traits: dequantize element (token `off` of the block, head h, channel d). ----
// block: the block's first byte; meta_offset / side_offset: where its scales / side parameters
// start; is_key: which int4 role (8-bit formats quantize keys and values alike).

template <int HEAD_DIM>
__device__ __forceinline__ float ue5m3_row_scale(const unsigned char* block, int off, int h, int num_kv_heads,
                                                i64 meta_offset) {
  return ue5m3_to_float(load_byte(block + meta_offset + static_cast<i64>(off) * num_kv_heads + h));
}

struct QuantInt8 {
  static constexpr bool kResidual = false;
  static constexpr int kMaxCode = 127;
  static constexpr bool kPowerOfTwoScale = false;
  __device__ static __forceinline__ unsigned int encode(float scaled) {
    const float r = fminf(fmaxf(rintf(scaled), -127.f), 127.f);
    return static_cast<unsigned int>(static_cast<int>(r)) & 0xffu;
  }
  __device__ static __forceinline__ float decode(unsigned int code) {
    return static_cast<float>(static_cast<signed char>(static_cast<unsigned char>(code)));
  }
  template <int HEAD_DIM>
  __device__ static __forceinline__ float load(const unsigned char* block, int off, int h, int d, int num_kv_heads,
                                               i64 meta_offset, i64, bool) {
    const i64 row = static_cast<i64>(off) * num_kv_heads + h;
    return decode(load_byte(block + row * HEAD_DIM + d)) * ue5m3_row_scale<HEAD_DIM>(block, off, h, num_kv_heads, meta_offset);
  }
};

struct QuantFp8 {
  static constexpr bool kResidual = false;
  static constexpr int kMaxCode = 448;
  static constexpr bool kPowerOfTwoScale = true;  // x / s exact (docs/quantized_kv.md, "8-bit")
  __device__ static __forceinline__ unsigned int encode(float scaled) { return float_to_e4m3(scaled); }
  __device__ static __forceinline__ float decode(unsigned int code) { return e4m3_to_float(code); }
  template <int HEAD_DIM>
  __device__ static __forceinline__ float load(const unsigned char* block, int off, int h, int d, int num_kv_heads,
                                               i64 meta_offset, i64, bool) {
    const i64 row = static_cast<i64>(off) * num_kv_heads + h;
    return decode(load_byte(block + row * HEAD_DIM + d)) * ue5m3_row_scale<HEAD_DIM>(block, off, h, num_kv_heads, meta_offset);
  }
};

// int4: codes two to a byte (low nibble: the even channel); one metadata byte per group (keys:
// per (head, channel); values: per (token, head)): center code << 4 | ladder index; three
// bfloat16 per head: center grid start, center grid step, half-step unit.
struct QuantInt4 {
  static constexpr bool kResidual = true;
  template <int HEAD_DIM>
  __device__ static __forceinline__ float load(const unsigned char* block, int off, int h, int d, int num_kv_heads,
                                               i64 meta_offset, i64 side_offset, bool is_key) {
    const i64 element = (static_cast<i64>(off) * num_kv_heads + h) * HEAD_DIM + d;
    const unsigned int code = (load_byte(block + element / 2) >> (4 * (d & 1))) & 0xfu;
    const i64 group = is_key ? static_cast<i64>(h) * HEAD_DIM + d : static_cast<i64>(off) * num_kv_heads + h;
    const unsigned int meta = load_byte(block + meta_offset + group);
    const unsigned char* side = block + side_offset + static_cast<i64>(h) * 6;
    const float chat = load_bf16_bytes(side) + static_cast<float>(meta >> 4) * load_bf16_bytes(side + 2);
    const float half = int4_level(meta & 0xfu) * load_bf16_bytes(side + 4);
    return chat + static_cast<float>(2 * static_cast<int>(code) - 15) * half;
  }
};

}  // namespace pagedkv
