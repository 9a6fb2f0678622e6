// Small kernels that probe the CPU emulation harness itself (cuda_emu.h): shuffles, partial
// masks, barriers, shared-memory poisoning and deadlock detection. Test-only, not shipped.
#include "kv_types.h"

namespace pagedkv {

// grid: (1); block: (64). out: [64, 6] per thread: xor 1, xor 16, broadcast lane 5, down 3 within
// 8-lane segments, up 2, and (lanes 0-15 / 16-31 in separate masks) xor 4 inside the half warp.
__global__ void shuffle_probe(float* __restrict__ out /* [64, 6] */) {
  const int tid = threadIdx.x;
  const float mine = static_cast<float>(tid);
  float* row = out + tid * 6;
  row[0] = __shfl_xor_sync(0xffffffffu, mine, 1);
  row[1] = __shfl_xor_sync(0xffffffffu, mine, 16);
  row[2] = __shfl_sync(0xffffffffu, mine, 5);
  row[3] = __shfl_down_sync(0xffffffffu, mine, 3, 8);
  row[4] = __shfl_up_sync(0xffffffffu, mine, 2);
  if ((tid & 31) < 16) {
    row[5] = __shfl_xor_sync(0x0000ffffu, mine, 4);
  } else {
    row[5] = __shfl_xor_sync(0xffff0000u, mine + 1000.f, 4);
  }
}

// grid: (num_blocks); block: (128). out: [num_blocks] = sum over the block of (blockIdx.x * 128 + tid),
// through shared memory and barriers; any missing barrier or stale shared value breaks the sum.
__global__ void block_sum_probe(float* __restrict__ out /* [num_blocks] */) {
  __shared__ float partial[128];
  const int tid = threadIdx.x;
  partial[tid] = static_cast<float>(blockIdx.x * 128 + tid);
  __syncthreads();
  for (int stride = 64; stride > 0; stride >>= 1) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    __syncthreads();
  }
  if (tid == 0) out[blockIdx.x] = partial[0];
}

// grid: (2); block: (32). Block 0 writes shared memory; block 1 only reads it. On a GPU the value
// block 1 sees is undefined; the harness must show NaN, never block 0's leftovers.
__global__ void stale_shared_probe(float* __restrict__ out /* [2, 32] */) {
  __shared__ float scratch[32];
  if (blockIdx.x == 0) scratch[threadIdx.x] = 7.f;
  __syncthreads();
  out[blockIdx.x * 32 + threadIdx.x] = scratch[threadIdx.x];
}

// grid: (1); block: (32). Lanes 16-31 exit; lanes 0-15 then read lane 20 (not in their mask).
__global__ void exited_lane_probe(float* __restrict__ out /* [32] */) {
  const int tid = threadIdx.x;
  out[tid] = -1.f;
  if (tid >= 16) return;
  out[tid] = __shfl_sync(0x0000ffffu, static_cast<float>(tid), 20);
}

// grid: (1); block: (32). Half the warp shuffles with a full mask while the other half waits at
// __syncthreads: a deadlock the harness must report instead of hanging.
__global__ void deadlock_probe(float* __restrict__ out /* [32] */) {
  const int tid = threadIdx.x;
  if (tid < 16) {
    out[tid] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
  } else {
    __syncthreads();
  }
}

// grid: (1); block: (1). out[0] = in[index], read and written as scalars: an index past `in`
// must fail the launch (the harness bounds-checks scalar accesses, not only 16-byte vectors).
__global__ void scalar_probe(float* __restrict__ out /* [1] */, const float* __restrict__ in /* [n] */,
                             long long index) {
  store_scalar(out, load_scalar(in + index));
}

}  // namespace pagedkv
