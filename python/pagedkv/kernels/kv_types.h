// Element types and 16-byte vector access shared by the pagedkv kernels.
//
// Self-contained on purpose: NVRTC ships no CUDA headers, so this file defines its own fp16/bf16
// storage types instead of including cuda_fp16.h. Under the CPU emulation (cuda_emu.h, which
// defines PKV_EMULATION) the same code compiles with g++.
#pragma once

#ifndef PKV_EMULATION
#define PKV_MAY_ALIAS
#endif

namespace pagedkv {

typedef long long i64;

// Storage types: the kernels never do arithmetic in 16 bits, they widen to fp32 on load.
struct f16 {
  unsigned short bits;  // IEEE binary16
};
struct bf16 {
  unsigned short bits;  // bfloat16: the high half of an fp32
};

// One 16-byte vector access. may_alias (emulation) because it is read over f16/bf16/float data.
struct alignas(16) vec16 {
  unsigned int x, y, z, w;
} PKV_MAY_ALIAS;

// Four floats read or written in one 16-byte shared-memory access.
struct alignas(16) f32x4 {
  float x, y, z, w;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ unsigned int vec_word(const vec16& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

__device__ __forceinline__ vec16 zero_vec16() {
  vec16 v;
  v.x = v.y = v.z = v.w = 0u;
  return v;
}

// KV loads are streamed once per group, so keep them out of L1.
__device__ __forceinline__ vec16 load_stream16(const void* ptr) {
  vec16 v;
#if defined(__CUDA_ARCH__)
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
#else
  pkv_emu::check_access(ptr, sizeof(vec16), "load");
  v = *reinterpret_cast<const vec16*>(ptr);
#endif
  return v;
}

__device__ __forceinline__ vec16 load16(const vec16* ptr) {
#if !defined(__CUDA_ARCH__)
  pkv_emu::check_access(ptr, sizeof(vec16), "load");
#endif
  return *ptr;
}

__device__ __forceinline__ void store16(vec16* ptr, const vec16& v) {
#if !defined(__CUDA_ARCH__)
  pkv_emu::check_access(ptr, sizeof(vec16), "store");
#endif
  *ptr = v;
}

// Scalar global-memory accesses (indices, lengths, addresses, outputs). On the GPU a plain
// access; under emulation bounds-checked like the 16-byte ones, so a stray index read or write
// aborts the launch with an error instead of touching memory outside the launch's arrays.
template <typename T>
__device__ __forceinline__ T load_scalar(const T* ptr) {
#if !defined(__CUDA_ARCH__)
  pkv_emu::check_access(ptr, sizeof(T), "scalar load");
#endif
  return *ptr;
}

template <typename T>
__device__ __forceinline__ void store_scalar(T* ptr, T value) {
#if !defined(__CUDA_ARCH__)
  pkv_emu::check_access(ptr, sizeof(T), "scalar store");
#endif
  *ptr = value;
}

__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return pkv_emu_half_bits_to_float(h);
#endif
}

__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
#if defined(__CUDA_ARCH__)
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return pkv_emu_float_to_half_bits(f);
#endif
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned short b) {
  return __uint_as_float(static_cast<unsigned int>(b) << 16);
}

// Round to nearest even, NaN stays a (quiet) NaN: the same rule NumPy-side references use.
__device__ __forceinline__ unsigned short float_to_bf16_bits(float f) {
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x0040u);
  const unsigned int rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(rounded >> 16);
}

// Per element type: how many elements a 16-byte vector holds, and widening/narrowing.
template <typename T>
struct Kv;

template <>
struct Kv<float> {
  static constexpr int kPerVec = 4;
  __device__ static __forceinline__ float elem(const vec16& v, int i) { return __uint_as_float(vec_word(v, i)); }
  __device__ static __forceinline__ float to_float(float x) { return x; }
  __device__ static __forceinline__ float from_float(float x) { return x; }
};

template <>
struct Kv<f16> {
  static constexpr int kPerVec = 8;
  __device__ static __forceinline__ float elem(const vec16& v, int i) {
    const unsigned int w = vec_word(v, i >> 1);
    return half_bits_to_float(static_cast<unsigned short>((i & 1) ? (w >> 16) : (w & 0xffffu)));
  }
  __device__ static __forceinline__ float to_float(f16 x) { return half_bits_to_float(x.bits); }
  __device__ static __forceinline__ f16 from_float(float x) {
    f16 r;
    r.bits = float_to_half_bits(x);
    return r;
  }
};

template <>
struct Kv<bf16> {
  static constexpr int kPerVec = 8;
  __device__ static __forceinline__ float elem(const vec16& v, int i) {
    const unsigned int w = vec_word(v, i >> 1);
    return (i & 1) ? __uint_as_float(w & 0xffff0000u) : __uint_as_float(w << 16);
  }
  __device__ static __forceinline__ float to_float(bf16 x) { return bf16_bits_to_float(x.bits); }
  __device__ static __forceinline__ bf16 from_float(float x) {
    bf16 r;
    r.bits = float_to_bf16_bits(x);
    return r;
  }
};

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace pagedkv
