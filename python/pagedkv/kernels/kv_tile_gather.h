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
// before `start` (keys before a sliding window) or at or past `end` are zero-filled and read
// nothing, not even their page-table entry. k_head/v_head point at the KV head's row of
// cache slot 0 and slot_bytes is the distance between slots; slot_of(token) is the token's cache
// slot (physical block * BLOCK_SIZE + offset, from the page table). `tile` < `end`, and the
// zero-filled copies point at token `tile`'s row, a valid address (slot_of(tile) is read, so
// `tile`'s block must be a mapped one: `tile` lies in the block of max(tile, start)).
// Address arithmetic (why it is written this way): a thread copies the same 16-byte column of
// every row it handles (kThreads is a multiple of the chunks per row), and a slot number fits 32
// bits (a cache of 2^32 tokens would not fit in GPU memory), so each copy's source is one 32 x 32
// -> 64-bit multiply-add onto a per-thread base instead of a 64-bit multiply and two shifts.
template <typename T, int HEAD_DIM, int kTokens, int kThreads, typename SlotOf>
__device__ __forceinline__ void gather_kv_tile_async(unsigned short (*k_dst)[PaddedRow<HEAD_DIM>::kHalves],
                                                     unsigned short (*v_dst)[PaddedRow<HEAD_DIM>::kHalves],
                                                     const T* k_head, const T* v_head, unsigned int slot_bytes,
                                                     int tile, int start, int end, int tid,
                                                     const SlotOf& slot_of) {
  constexpr int kChunks = PaddedRow<HEAD_DIM>::kChunks;
  constexpr int kRowStep = kThreads / kChunks;  // rows between one thread's copies
  static_assert(kThreads % kChunks == 0 && kTokens % kRowStep == 0, "threads must tile a K/V tile");
  const int part = tid % kChunks;
  const int row0 = tid / kChunks;
  const char* k_base = reinterpret_cast<const char*>(k_head + part * 8);
  const char* v_base = reinterpret_cast<const char*>(v_head + part * 8);
#pragma unroll
  for (int c = 0; c < kTokens / kRowStep; ++c) {
    const int row = row0 + c * kRowStep;
    const int token = tile + row;
    const bool valid = token >= start && token < end;
    const unsigned long long offset =
        static_cast<unsigned long long>(slot_of(valid ? token : tile)) * static_cast<unsigned long long>(slot_bytes);
    cp_async16(&k_dst[row][part * 8], k_base + offset, valid);
    cp_async16(&v_dst[row][part * 8], v_base + offset, valid);
  }
}

}  // namespace pagedkv
