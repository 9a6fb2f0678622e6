// KV cache maintenance: scatter new tokens into their slots, and copy whole blocks (copy-on-write).
// Both are pure data movement in 16-byte vectors; UNROLL loads are issued before their stores so
// that several are in flight per thread.
#include "kv_types.h"

namespace pagedkv {

constexpr int kCopyThreads = 128;

// Copies n 16-byte vectors from src to dst with the block's threads.
template <int UNROLL>
__device__ __forceinline__ void copy_vecs(vec16* __restrict__ dst, const vec16* __restrict__ src, i64 n) {
  const i64 step = static_cast<i64>(kCopyThreads) * UNROLL;
  for (i64 base = threadIdx.x; base < n; base += step) {
    vec16 regs[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const i64 i = base + static_cast<i64>(u) * kCopyThreads;
      regs[u] = i < n ? load16(src + i) : zero_vec16();
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const i64 i = base + static_cast<i64>(u) * kCopyThreads;
      if (i < n) store16(dst + i, regs[u]);
    }
  }
}

// grid: (num_tokens); block: kCopyThreads threads.
// Token t's keys and values go to slot slot_mapping[t] (= block_id * block_size + offset); a
// negative slot marks a padding token and is skipped.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kCopyThreads) write_kv_kernel(
    T* __restrict__ k_cache,                   // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    T* __restrict__ v_cache,                   // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    const T* __restrict__ k,                   // [num_tokens, num_kv_heads, HEAD_DIM]
    const T* __restrict__ v,                   // [num_tokens, num_kv_heads, HEAD_DIM]
    const i64* __restrict__ slot_mapping,      // [num_tokens]
    int num_kv_heads) {
  static_assert(HEAD_DIM * sizeof(T) % 16 == 0, "a head row must be whole 16-byte vectors");
  const i64 token = blockIdx.x;
  const i64 slot = load_scalar(slot_mapping + token);
  if (slot < 0) return;
  const i64 row_elems = static_cast<i64>(num_kv_heads) * HEAD_DIM;
  const i64 row_vecs = row_elems * static_cast<i64>(sizeof(T)) / 16;
  copy_vecs<2>(reinterpret_cast<vec16*>(k_cache + slot * row_elems),
               reinterpret_cast<const vec16*>(k + token * row_elems), row_vecs);
  copy_vecs<2>(reinterpret_cast<vec16*>(v_cache + slot * row_elems),
               reinterpret_cast<const vec16*>(v + token * row_elems), row_vecs);
}

// grid: (num_copies, num_layers, 2); block: kCopyThreads threads.
// Copies block copy_ops[c][0] onto block copy_ops[c][1] in layer l's key (z = 0) or value
// (z = 1) cache; one launch runs every pending copy of every layer. The launcher guarantees that
// no copy in a launch reads or writes a block another copy of the same launch writes.
template <int UNROLL>
__global__ void __launch_bounds__(kCopyThreads) copy_blocks_kernel(
    const i64* __restrict__ cache_addresses,  // [2, num_layers]: k_cache then v_cache address of each
                                              // layer, each [num_blocks, block_size, num_kv_heads, head_dim]
    const int* __restrict__ copy_ops,         // [num_copies, 2] (src_block, dst_block)
    i64 block_vecs) {                         // 16-byte vectors per block
  const i64 copy = blockIdx.x;
  const int layer = blockIdx.y;
  const int which = blockIdx.z;
  const int num_layers = gridDim.y;
  vec16* cache = reinterpret_cast<vec16*>(load_scalar(cache_addresses + static_cast<i64>(which) * num_layers + layer));
  const i64 src = load_scalar(copy_ops + copy * 2);
  const i64 dst = load_scalar(copy_ops + copy * 2 + 1);
  copy_vecs<UNROLL>(cache + dst * block_vecs, cache + src * block_vecs, block_vecs);
}

}  // namespace pagedkv
