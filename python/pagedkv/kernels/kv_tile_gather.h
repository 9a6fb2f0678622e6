// Shared by the tensor-core kernels (paged prefill, tensor-core decode): gathering one KV head's
// rows of a run of tokens from the paged cache into shared memory with cp.async, and reading two
// 16-bit elements of a global array as one 32-bit register.
#pragma once

#include "mma_sm80.h"

namespace pagedkv {

// Two 16-bit elements read as one word (may_alias under the emulation: the storage is f16/bf16).
typedef unsigned int word_alias PKV_MAY_ALIAS;

// Shared-memory rows of a K/V tile are padded by 16 bytes so the 8 row addresses of one ldmatrix
// fall in distinct banks.
template <int HEAD_DIM>
struct PaddedRow {
  static constexpr int kHalves = HEAD_DIM + 8;
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks of one token's row
};

// Issues (does not commit) the cp.async copies of tokens [tile, tile + kTokens) of one KV head
// into k_dst/v_dst rows 0..kTokens-1, kThreads threads sharing the 16-byte chunks; rows of tokens
// at or past `end` are zero-filled and read nothing. slot_of(token) is the token's cache slot
// (physical block * BLOCK_SIZE + offset, from the page table); `tile` < `end`, and zero-filled
// copies point at token `tile`'s row, a valid address.
template <typename T, int HEAD_DIM, int kTokens, int kThreads, typename SlotOf>
__device__ __forceinline__ void gather_kv_tile_async(unsigned short (*k_dst)[PaddedRow<HEAD_DIM>::kHalves],
                                                     unsigned short (*v_dst)[PaddedRow<HEAD_DIM>::kHalves],
                                                     const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                                     i64 slot_stride, i64 head_offset, int tile, int end, int tid,
                                                     const SlotOf& slot_of) {
  constexpr int kChunks = PaddedRow<HEAD_DIM>::kChunks;
  static_assert(kTokens * kChunks % kThreads == 0, "threads must tile a K/V tile");
#pragma unroll
  for (int c = 0; c < kTokens * kChunks / kThreads; ++c) {
    const int chunk = tid + c * kThreads;
    const int row = chunk / kChunks;
    const int part = chunk % kChunks;
    const int token = tile + row;
    const bool valid = token < end;
    const i64 offset = slot_of(valid ? token : tile) * slot_stride + head_offset + part * 8;
    cp_async16(&k_dst[row][part * 8], k_cache + offset, valid);
    cp_async16(&v_dst[row][part * 8], v_cache + offset, valid);
  }
}

}  // namespace pagedkv
