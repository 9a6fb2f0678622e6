// Paged decode attention: one new query token per sequence attends to that sequence's keys and
// values, which live in fixed-size blocks of a shared cache found through the block table.
//
// Work split (why): decode attention is bound by reading the KV cache, so a thread block owns one
// (sequence, KV head, split) and computes every query head of that KV head's group; each K/V byte
// is then read from memory once per group instead of once per query head. Each thread keeps
// kVecsPerThread 16-byte K loads and as many V loads in flight, and the next tile's loads are
// issued before the current tile is consumed. Long contexts are cut into splits (more blocks for
// the GPU to run in parallel) whose partial results merge_splits_kernel combines.
//
// Softmax is the online (running max) form in fp32, in the base-2 domain: q is pre-scaled by
// scale * log2(e) so each probability is a single exp2.
#include "kv_types.h"

namespace pagedkv {

constexpr int kDecodeThreads = 128;
constexpr int kVecsPerThread = 4;
constexpr int kMergeThreads = 128;

// The thread layout of one tile, derived from the element type and head size.
template <typename T, int HEAD_DIM>
struct DecodeShape {
  static constexpr int kElemsPerVec = Kv<T>::kPerVec;
  static constexpr int kVecsPerRow = HEAD_DIM / kElemsPerVec;  // 16-byte vectors in one token's row
  // Tokens per tile: every thread loads kVecsPerThread vectors of K (and of V) per tile.
  static constexpr int kTileTokens = kDecodeThreads * kVecsPerThread / kVecsPerRow;
  // Scores: kQkLanes consecutive lanes split one token's K row and sum their partial dots.
  static constexpr int kQkLanes = kVecsPerRow / kVecsPerThread;
  // Values: a thread owns one 16-byte column slice; kPvRowGroups threads share each column and
  // take every kPvRowGroups-th token of the tile.
  static constexpr int kPvRowGroups = kDecodeThreads / kVecsPerRow;
  static_assert(HEAD_DIM % kElemsPerVec == 0, "head_dim must fill 16-byte vectors");
  static_assert(kVecsPerRow % kVecsPerThread == 0, "head row must split into kVecsPerThread vectors");
  static_assert(kQkLanes >= 1 && kQkLanes <= 32 && (kQkLanes & (kQkLanes - 1)) == 0, "lanes per row");
  static_assert(kDecodeThreads % kVecsPerRow == 0, "threads must tile the head row");
  static_assert(kTileTokens / kPvRowGroups == kVecsPerThread, "V rows per thread");
  static_assert(kTileTokens <= 64, "softmax reads at most two rows per lane");
};

// grid: (num_kv_heads, num_seqs, num_splits); block: kDecodeThreads threads.
// Block (h, b, s) handles query heads [h * group_size, (h + 1) * group_size) of sequence b over
// tokens [s * tokens_per_split, min((s + 1) * tokens_per_split, seq_lens[b])). With one split it
// writes `out`; otherwise the normalized partial output, its max and its denominator per split.
// GROUP >= group_size is the compile-time group; the heads past group_size are padding.
// window > 0 (sliding-window attention, inclusive): the query at position seq_len - 1 sees keys
// [first, seq_len) with first = max(0, seq_len - window) only, and the splits cut that span:
// split s covers [first + s * tokens_per_split, ...). No key (nor its page-table entry, which may
// be -1 for a released block) before `first` is ever read. window <= 0: no window.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int GROUP>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_kernel(
    T* __restrict__ out,                   // [num_seqs, num_q_heads, HEAD_DIM]
    float* __restrict__ split_out,         // [num_seqs, num_q_heads, num_splits, HEAD_DIM]
    float* __restrict__ split_max,         // [num_seqs, num_q_heads, num_splits] (log2 domain)
    float* __restrict__ split_sum,         // [num_seqs, num_q_heads, num_splits]
    const T* __restrict__ q,               // [num_seqs, num_q_heads, HEAD_DIM]
    const T* __restrict__ k_cache,         // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    const T* __restrict__ v_cache,         // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,      // [num_seqs]
    int num_kv_heads, int group_size, int max_blocks_per_seq, int tokens_per_split, float scale_log2,
    int window) {
  using Shape = DecodeShape<T, HEAD_DIM>;
  constexpr int E = Shape::kElemsPerVec;
  constexpr int kTile = Shape::kTileTokens;
  constexpr int kQkLanes = Shape::kQkLanes;
  constexpr int kRowGroups = Shape::kPvRowGroups;
  constexpr int kDecodeWarps = kDecodeThreads / 32;
  constexpr int kHeadsPerWarp = (GROUP + kDecodeWarps - 1) / kDecodeWarps;

  constexpr int kQuads = HEAD_DIM / 4;
  __shared__ f32x4 q_sm[GROUP][kQuads];  // read as 16-byte vectors by the score loop
  __shared__ float p_sm[2][GROUP][kTile];  // scores, then probabilities; double-buffered by tile
  __shared__ float alpha_sm[2][GROUP];     // rescale factor of the running sums for this tile
  __shared__ float max_sm[GROUP];
  __shared__ float sum_sm[GROUP];
  __shared__ float reduce_sm[kRowGroups][HEAD_DIM];

  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int num_splits = gridDim.z;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int num_q_heads = num_kv_heads * group_size;

  const int seq_len = load_scalar(seq_lens + seq);
  // Tokens are gathered one row at a time, so the key loop starts at the first visible key itself.
  const int first = window > 0 ? max(0, seq_len - window) : 0;
  const int begin = first + split * tokens_per_split;
  const int end = min(seq_len, begin + tokens_per_split);
  const i64 slot_stride = static_cast<i64>(num_kv_heads) * HEAD_DIM;  // elements between slots
  const i64 head_offset = static_cast<i64>(kv_head) * HEAD_DIM;
  const int* table = block_tables + static_cast<i64>(seq) * max_blocks_per_seq;

  // q for this group, scaled into the log2 domain; padded heads (g >= group_size) are zero.
  for (int i = tid; i < GROUP * kQuads; i += kDecodeThreads) {
    const int g = i / kQuads;
    const int quad = i % kQuads;
    f32x4 x = {0.f, 0.f, 0.f, 0.f};
    if (g < group_size) {
      const T* src = q + (static_cast<i64>(seq) * num_q_heads + kv_head * group_size + g) * HEAD_DIM + quad * 4;
      x.x = Kv<T>::to_float(load_scalar(src + 0)) * scale_log2;
      x.y = Kv<T>::to_float(load_scalar(src + 1)) * scale_log2;
      x.z = Kv<T>::to_float(load_scalar(src + 2)) * scale_log2;
      x.w = Kv<T>::to_float(load_scalar(src + 3)) * scale_log2;
    }
    q_sm[g][quad] = x;
  }

  // Scores role: token row qk_row of the tile, vectors qk_part + j * kQkLanes of its K row.
  const int qk_row = tid / kQkLanes;
  const int qk_part = tid % kQkLanes;
  // Values role: column slice pv_col of rows pv_group + j * kRowGroups.
  const int pv_col = tid % Shape::kVecsPerRow;
  const int pv_group = tid / Shape::kVecsPerRow;

  auto slot_of = [&](int token) -> i64 {
    return static_cast<i64>(load_scalar(table + token / BLOCK_SIZE)) * BLOCK_SIZE + token % BLOCK_SIZE;
  };
  // Rows past `end` are never read (unused slots may hold anything, NaN included): zeros instead.
  auto load_tile = [&](int tile_begin, vec16 (&k_regs)[kVecsPerThread], vec16 (&v_regs)[kVecsPerThread]) {
    const int k_token = tile_begin + qk_row;
    if (k_token < end) {
      const T* row = k_cache + slot_of(k_token) * slot_stride + head_offset;
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) k_regs[j] = load_stream16(row + (j * kQkLanes + qk_part) * E);
    } else {
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) k_regs[j] = zero_vec16();
    }
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      const int v_token = tile_begin + pv_group + j * kRowGroups;
      v_regs[j] = v_token < end ? load_stream16(v_cache + slot_of(v_token) * slot_stride + head_offset + pv_col * E)
                                : zero_vec16();
    }
  };

  float acc[GROUP][E];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  }
  // Running max and denominator of head warp + hh * kDecodeWarps, held by every lane of that warp.
  float m_run[kHeadsPerWarp];
  float l_run[kHeadsPerWarp];
#pragma unroll
  for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
    m_run[hh] = neg_inf();
    l_run[hh] = 0.f;
  }

  vec16 k_cur[kVecsPerThread];
  vec16 v_cur[kVecsPerThread];
  if (begin < end) load_tile(begin, k_cur, v_cur);
  __syncthreads();  // q_sm complete

  int buf = 0;
  for (int tile = begin; tile < end; tile += kTile) {
    const bool has_next = tile + kTile < end;
    vec16 k_next[kVecsPerThread];
    vec16 v_next[kVecsPerThread];
    if (has_next) load_tile(tile + kTile, k_next, v_next);

    // 1. Scores of this thread's row, summed over the kQkLanes lanes sharing it.
    float dots[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) dots[g] = 0.f;
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      float kx[E];
#pragma unroll
      for (int e = 0; e < E; ++e) kx[e] = Kv<T>::elem(k_cur[j], e);
      const int quad0 = (j * kQkLanes + qk_part) * (E / 4);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int c = 0; c < E / 4; ++c) {
          // One FMA chain: the a*b + c*d + ... form compiles to FMUL + FFMA + FADD per four
          // products, and instruction issue, not memory, bounds the grouped instances.
          const f32x4 qv = q_sm[g][quad0 + c];
          dots[g] = fmaf(qv.x, kx[4 * c], dots[g]);
          dots[g] = fmaf(qv.y, kx[4 * c + 1], dots[g]);
          dots[g] = fmaf(qv.z, kx[4 * c + 2], dots[g]);
          dots[g] = fmaf(qv.w, kx[4 * c + 3], dots[g]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int offset = kQkLanes / 2; offset > 0; offset >>= 1) {
        dots[g] += __shfl_xor_sync(0xffffffffu, dots[g], offset);
      }
    }
    if (qk_part == 0) {
      const bool valid = tile + qk_row < end;
#pragma unroll
      for (int g = 0; g < GROUP; ++g) p_sm[buf][g][qk_row] = valid ? dots[g] : neg_inf();
    }
    __syncthreads();

    // 2. Online softmax update, one warp per head (the tile's first row is always valid).
#pragma unroll
    for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
      const int g = warp + hh * kDecodeWarps;
      if (g < GROUP) {
        const float s0 = lane < kTile ? p_sm[buf][g][lane] : neg_inf();
        const float s1 = lane + 32 < kTile ? p_sm[buf][g][lane + 32] : neg_inf();
        const float m_new = fmaxf(m_run[hh], warp_max(fmaxf(s0, s1)));
        const float alpha = exp2f(m_run[hh] - m_new);
        const float p0 = exp2f(s0 - m_new);
        const float p1 = exp2f(s1 - m_new);
        if (lane < kTile) p_sm[buf][g][lane] = p0;
        if (lane + 32 < kTile) p_sm[buf][g][lane + 32] = p1;
        l_run[hh] = l_run[hh] * alpha + warp_sum(p0 + p1);
        m_run[hh] = m_new;
        if (lane == 0) alpha_sm[buf][g] = alpha;
      }
    }
    __syncthreads();

    // 3. Rescale and accumulate this thread's rows of V.
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float alpha = alpha_sm[buf][g];
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= alpha;
    }
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      const int row = pv_group + j * kRowGroups;
      float vx[E];
#pragma unroll
      for (int e = 0; e < E; ++e) vx[e] = Kv<T>::elem(v_cur[j], e);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float p = p_sm[buf][g][row];
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] += p * vx[e];
      }
    }
    buf ^= 1;
    if (has_next) {
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        k_cur[j] = k_next[j];
        v_cur[j] = v_next[j];
      }
    }
  }

  // Publish each head's softmax state, then sum the row groups' partial outputs head by head.
#pragma unroll
  for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
    const int g = warp + hh * kDecodeWarps;
    if (g < GROUP && lane == 0) {
      max_sm[g] = m_run[hh];
      sum_sm[g] = l_run[hh];
    }
  }
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    __syncthreads();  // reduce_sm is free again, max_sm/sum_sm are visible
#pragma unroll
    for (int e = 0; e < E; ++e) reduce_sm[pv_group][pv_col * E + e] = acc[g][e];
    __syncthreads();
    if (g < group_size) {
      const int head = kv_head * group_size + g;
      const float denom = sum_sm[g];
      const i64 row = static_cast<i64>(seq) * num_q_heads + head;
      for (int d = tid; d < HEAD_DIM; d += kDecodeThreads) {
        float total = 0.f;
#pragma unroll
        for (int r = 0; r < kRowGroups; ++r) total += reduce_sm[r][d];
        const float value = denom > 0.f ? total / denom : 0.f;
        if (num_splits == 1) {
          store_scalar(out + row * HEAD_DIM + d, Kv<T>::from_float(value));
        } else {
          const i64 part = row * num_splits + split;
          store_scalar(split_out + part * HEAD_DIM + d, value);
          if (d == 0) {
            store_scalar(split_max + part, max_sm[g]);
            store_scalar(split_sum + part, denom);
          }
        }
      }
    }
  }
}

// grid: (num_q_heads, num_seqs); block: kMergeThreads threads.
// Combines the num_splits normalized partial outputs of one (sequence, query head): each split
// weighs in with its denominator rescaled to the common max.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kMergeThreads) merge_splits_kernel(
    T* __restrict__ out,                // [num_seqs, num_q_heads, HEAD_DIM]
    const float* __restrict__ split_out,  // [num_seqs, num_q_heads, num_splits, HEAD_DIM]
    const float* __restrict__ split_max,  // [num_seqs, num_q_heads, num_splits]
    const float* __restrict__ split_sum,  // [num_seqs, num_q_heads, num_splits]
    int num_splits) {
  constexpr int kMaxSplits = 256;  // the launcher never asks for more (instances.MAX_SPLITS)
  __shared__ float weight_sm[kMaxSplits];
  __shared__ float total_sm;
  const i64 row = static_cast<i64>(blockIdx.y) * gridDim.x + blockIdx.x;
  const int tid = threadIdx.x;
  if (tid < 32) {
    float m = neg_inf();
    for (int s = tid; s < num_splits; s += 32) m = fmaxf(m, load_scalar(split_max + row * num_splits + s));
    m = warp_max(m);
    float total = 0.f;
    for (int s = tid; s < num_splits; s += 32) {
      const float w = m == neg_inf() ? 0.f : load_scalar(split_sum + row * num_splits + s) * exp2f(load_scalar(split_max + row * num_splits + s) - m);
      weight_sm[s] = w;
      total += w;
    }
    total = warp_sum(total);
    if (tid == 0) total_sm = total;
  }
  __syncthreads();
  const float total = total_sm;
  for (int d = tid; d < HEAD_DIM; d += kMergeThreads) {
    float acc = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float w = weight_sm[s];
      if (w > 0.f) acc += w * load_scalar(split_out + (row * num_splits + s) * HEAD_DIM + d);
    }
    store_scalar(out + row * HEAD_DIM + d, Kv<T>::from_float(total > 0.f ? acc / total : 0.f));
  }
}

}  // namespace pagedkv
