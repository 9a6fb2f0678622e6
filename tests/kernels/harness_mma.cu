// Probes of the tensor-core building blocks (mma_sm80.h): mma.sync m16n8k16 fragment layouts,
// ldmatrix (plain and transposed), the ldmatrix -> mma combination the attention kernels use,
// cp.async groups and fp16x2/bf16x2 packing. The same source runs under the CPU emulation
// (cuda_emu_mma.h) and, in the gpu-marked tests, on a real GPU, so the emulated layouts are
// checked against the hardware. Test-only, not shipped.
#include "mma_sm80.h"

namespace pagedkv {

// grid: (1); block: (32). Fragments built straight from global memory with the PTX ISA's
// layout formulas (independent of ldmatrix), one mma, D written back by the C/D formula.
template <typename T>
__global__ void mma_fragment_probe(float* __restrict__ d,                // [16, 8]
                                   const unsigned short* __restrict__ a,  // [16, 16] row major
                                   const unsigned short* __restrict__ b,  // [8, 16]: B^T (n, k)
                                   const float* __restrict__ c) {         // [16, 8]
  const int lane = threadIdx.x;
  const int group = lane >> 2;
  const int tig = lane & 3;
  unsigned int af[4];
  for (int r = 0; r < 4; ++r) {
    unsigned int word = 0;
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * r + h;
      const int row = group + 8 * ((i >> 1) & 1);
      const int col = 2 * tig + (i & 1) + 8 * (i >> 2);
      word |= static_cast<unsigned int>(a[row * 16 + col]) << (16 * h);
    }
    af[r] = word;
  }
  unsigned int bf[2];
  for (int r = 0; r < 2; ++r) {
    unsigned int word = 0;
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * r + h;
      const int k = 2 * tig + (i & 1) + 8 * (i >> 1);
      word |= static_cast<unsigned int>(b[group * 16 + k]) << (16 * h);
    }
    bf[r] = word;
  }
  float cf[4];
  for (int i = 0; i < 4; ++i) cf[i] = c[(group + 8 * (i >> 1)) * 8 + 2 * tig + (i & 1)];
  float df[4];
  mma_16816<T>(df, af, bf, cf);
  for (int i = 0; i < 4; ++i) d[(group + 8 * (i >> 1)) * 8 + 2 * tig + (i & 1)] = df[i];
}

// grid: (1); block: (32). m: [4, 8, 8] b16 matrices copied to shared memory; out: [32, 8] per
// lane: ldmatrix_x4 registers 0..3, then ldmatrix_x4_trans registers 0..3.
__global__ void ldmatrix_probe(unsigned int* __restrict__ out,            // [32, 8]
                               const unsigned short* __restrict__ m) {    // [4, 8, 8]
  alignas(16) __shared__ unsigned short tile[4][8][8];
  const int lane = threadIdx.x;
  for (int i = lane; i < 4 * 8 * 8; i += 32) (&tile[0][0][0])[i] = m[i];
  __syncthreads();
  unsigned int r[4];
  ldmatrix_x4(r, &tile[lane / 8][lane % 8][0]);
  for (int j = 0; j < 4; ++j) out[lane * 8 + j] = r[j];
  ldmatrix_x4_trans(r, &tile[lane / 8][lane % 8][0]);
  for (int j = 0; j < 4; ++j) out[lane * 8 + 4 + j] = r[j];
}

// grid: (1); block: (32). The attention kernels' pattern: A (16x16, row major) by ldmatrix_x4,
// B from a K-contiguous tile bk ([8 n][16 k], as keys are stored) by ldmatrix_x2, and from a
// row-major tile bv ([16 k][8 n], as values are stored) by ldmatrix_x2_trans.
// d_k = a @ bk^T + c, d_v = a @ bv + c.
template <typename T>
__global__ void ldmatrix_mma_probe(float* __restrict__ d_k,               // [16, 8]
                                   float* __restrict__ d_v,               // [16, 8]
                                   const unsigned short* __restrict__ a,  // [16, 16]
                                   const unsigned short* __restrict__ bk, // [8, 16]
                                   const unsigned short* __restrict__ bv, // [16, 8]
                                   const float* __restrict__ c) {         // [16, 8]
  alignas(16) __shared__ unsigned short a_sm[16][16];
  alignas(16) __shared__ unsigned short bk_sm[8][16];
  alignas(16) __shared__ unsigned short bv_sm[16][8];
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) (&a_sm[0][0])[i] = a[i];
  for (int i = lane; i < 128; i += 32) {
    (&bk_sm[0][0])[i] = bk[i];
    (&bv_sm[0][0])[i] = bv[i];
  }
  __syncthreads();
  const int group = lane >> 2;
  const int tig = lane & 3;
  unsigned int af[4];
  // matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
  ldmatrix_x4(af, &a_sm[lane % 16][(lane / 16) * 8]);
  unsigned int bkf[2];
  ldmatrix_x2(bkf, &bk_sm[lane % 8][((lane / 8) % 2) * 8]);
  unsigned int bvf[2];
  ldmatrix_x2_trans(bvf, &bv_sm[lane % 16][0]);
  float cf[4];
  for (int i = 0; i < 4; ++i) cf[i] = c[(group + 8 * (i >> 1)) * 8 + 2 * tig + (i & 1)];
  float dk[4];
  float dv[4];
  mma_16816<T>(dk, af, bkf, cf);
  mma_16816<T>(dv, af, bvf, cf);
  for (int i = 0; i < 4; ++i) {
    d_k[(group + 8 * (i >> 1)) * 8 + 2 * tig + (i & 1)] = dk[i];
    d_v[(group + 8 * (i >> 1)) * 8 + 2 * tig + (i & 1)] = dv[i];
  }
}

// grid: (1); block: (32). Each lane copies 16-byte chunks of src [3, 32, 4] (three groups) into
// shared memory with cp.async: group 0 and 1 copy, group 2 zero-fills. out [4, 32, 4]:
// 0: group 0 after wait_group<2> (complete), 1: group 1 read before its wait (NaN under emulation,
// racy on a GPU: not checked there), 2: group 1 after wait_group<1>, 3: group 2 after wait<0>.
__global__ void cp_async_probe(float* __restrict__ out,          // [4, 32, 4]
                               const float* __restrict__ src) {  // [3, 32, 4]
  alignas(16) __shared__ float buf[3][32][4];
  const int lane = threadIdx.x;
  cp_async16(&buf[0][lane][0], src + (0 * 32 + lane) * 4, true);
  cp_async_commit();
  cp_async16(&buf[1][lane][0], src + (1 * 32 + lane) * 4, true);
  cp_async_commit();
  cp_async16(&buf[2][lane][0], src + (2 * 32 + lane) * 4, false);
  cp_async_commit();
  cp_async_wait<2>();
  for (int e = 0; e < 4; ++e) out[(0 * 32 + lane) * 4 + e] = buf[0][lane][e];
  for (int e = 0; e < 4; ++e) out[(1 * 32 + lane) * 4 + e] = buf[1][lane][e];
  cp_async_wait<1>();
  for (int e = 0; e < 4; ++e) out[(2 * 32 + lane) * 4 + e] = buf[1][lane][e];
  cp_async_wait<0>();
  for (int e = 0; e < 4; ++e) out[(3 * 32 + lane) * 4 + e] = buf[2][lane][e];
}

// grid: (1); block: (32). out[lane] = pack2<T>(x[2 lane], x[2 lane + 1]).
template <typename T>
__global__ void pack_probe(unsigned int* __restrict__ out, const float* __restrict__ x /* [64] */) {
  const int lane = threadIdx.x;
  out[lane] = pack2<T>(x[2 * lane], x[2 * lane + 1]);
}

// grid: (1); block: (16). mma with half a warp: the harness must refuse it.
__global__ void partial_warp_mma_probe(float* __restrict__ out /* [16] */) {
  unsigned int a[4] = {0u, 0u, 0u, 0u};
  unsigned int b[2] = {0u, 0u};
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  mma_16816<f16>(c, a, b, c);
  out[threadIdx.x] = c[0];
}

// grid: (1); block: (32). ldmatrix from global memory: the harness must refuse it.
__global__ void ldmatrix_global_probe(unsigned int* __restrict__ out /* [32, 4] */) {
  unsigned int r[4];
  ldmatrix_x4(r, out + (threadIdx.x % 8) * 4);
  out[threadIdx.x * 4] = r[0];
}

}  // namespace pagedkv
