// Warp-level tensor-core building blocks (sm_80 and later, so sm_90 too): mma.sync m16n8k16 with
// fp16 or bf16 inputs and fp32 accumulation, ldmatrix, cp.async with commit/wait groups, and
// packing two floats into one 32-bit fp16x2/bf16x2 register.
//
// On the GPU each function is one PTX instruction. Compiled for the CPU (cuda_emu.h defines
// PKV_EMULATION) they call the emulation in cuda_emu_mma.h, which implements the PTX ISA's
// fragment layouts (documented there) so the same kernel source runs and is tested on the CPU.
#pragma once

#include "kv_types.h"

#if !defined(__CUDA_ARCH__)
#include "cuda_emu_mma.h"
#endif

namespace pagedkv {

// The shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned int smem_addr(const void* ptr) {
#if defined(__CUDA_ARCH__)
  unsigned int addr;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(ptr));
  return addr;
#else
  (void)ptr;
  return 0u;
#endif
}

// Element types the tensor cores take: f16 and bf16 (kv_types.h storage types).
template <typename T>
struct MmaType;
template <>
struct MmaType<f16> {
  static constexpr bool kBf16 = false;
};
template <>
struct MmaType<bf16> {
  static constexpr bool kBf16 = true;
};

// d = a * b + c over one 16x8x16 tile; a: 4 registers of A (16x16, row major), b: 2 registers of
// B (16x8, K-contiguous), c/d: 4 floats of C/D (16x8). d may alias c.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2],
                                          const float (&c)[4]) {
#if defined(__CUDA_ARCH__)
  if constexpr (MmaType<T>::kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  }
#else
  pkv_emu::mma_m16n8k16(d, a, b, c, MmaType<T>::kBf16);
#endif
}

// ldmatrix.x4: four 8x8 b16 matrices; lane l passes the address of row l % 8 of matrix l / 8
// (16-byte aligned, in shared memory).
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
#else
  pkv_emu::ldmatrix(r, 4, false, row);
#endif
}

// ldmatrix.x4.trans: as ldmatrix_x4, each 8x8 matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
#else
  pkv_emu::ldmatrix(r, 4, true, row);
#endif
}

// ldmatrix.x2: two 8x8 matrices; lanes 0..15 pass row addresses (the others' are ignored).
__device__ __forceinline__ void ldmatrix_x2(unsigned int (&r)[2], const void* row) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(row)));
#else
  pkv_emu::ldmatrix(r, 2, false, row);
#endif
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned int (&r)[2], const void* row) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(row)));
#else
  pkv_emu::ldmatrix(r, 2, true, row);
#endif
}

// 16-byte asynchronous global -> shared copy (L2 only: tiles are read once per block); with
// fill == false the destination is zero-filled and nothing is read (src must still be a valid
// address on the GPU path's side of caution, e.g. the tile's first row).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool fill) {
#if defined(__CUDA_ARCH__)
  const int src_bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(smem_dst)), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
#else
  pkv_emu::cp_async16(smem_dst, gmem_src, fill ? 16 : 0);
#endif
}

// Closes the group of cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;" ::: "memory");
#else
  pkv_emu::cp_async_commit();
#endif
}

// Waits until at most `kPending` committed groups of this thread are still in flight. Other
// threads' copies become visible only after a following __syncthreads.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#else
  pkv_emu::cp_async_wait(kPending);
#endif
}

// Two floats -> one register of two 16-bit values (lo in the low half), round to nearest even.
template <typename T>
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  unsigned int r;
  if constexpr (MmaType<T>::kBf16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
#else
  if constexpr (MmaType<T>::kBf16) {
    return static_cast<unsigned int>(float_to_bf16_bits(lo)) |
           (static_cast<unsigned int>(float_to_bf16_bits(hi)) << 16);
  } else {
    return static_cast<unsigned int>(float_to_half_bits(lo)) |
           (static_cast<unsigned int>(float_to_half_bits(hi)) << 16);
  }
#endif
}

}  // namespace pagedkv
