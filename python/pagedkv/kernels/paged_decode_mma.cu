// Paged decode attention on tensor cores, for grouped queries (GQA groups of 3 to 8 query heads
// per KV head, fp16/bf16 caches). Same contract, grid, split buffers and merge kernel as
// paged_decode_kernel (paged_attention.cu); the launcher picks this one by the rule in
// attention/kernel_launch.decode_instance.
//
// Why: with one query token per head the CUDA-core kernel spends ~0.2-0.3 warp-instructions per
// byte of KV on group 4/8 (FFMA per element per head), enough to bound it by instruction issue
// rather than HBM. mma.sync m16n8k16 does 16x8x16 multiply-adds per instruction. The group is
// small, so it goes on mma's n = 8 side and the tokens on m = 16 (scores transposed):
//   S^T [16 tokens x 8 heads]  = K [16 tokens x 16 dims] . Q^T [16 dims x 8 heads]
//   O^T [16 dims x 8 heads]   += V^T [16 dims x 16 tokens] . P^T [16 tokens x 8 heads]
// A group of fewer than 8 heads leaves the rest of n as zero-query padding (never written out).
//
// Work split: a block owns (KV head, sequence, split) as in the CUDA-core kernel; tiles of kTile
// tokens (the CUDA-core kernel's tile, so the split planner's whole-tile splits hold for both)
// are gathered into shared memory with cp.async, double-buffered, through page-table entries
// staged in shared memory one tile ahead. Scores: the 4 warps split the tile's 16-token steps
// and, where a tile has fewer steps than warps, the head dimensions (K fragments by ldmatrix, Q^T
// fragments held in registers for the whole split); the partial scores go through shared memory,
// and every warp reads all of them back, summed, runs the same online softmax (bit-identical:
// same sums in the same order) and accumulates O^T for its own quarter of the head dimensions
// (V^T fragments by ldmatrix.trans). Reading the scores in mma's B-fragment layout gives
// P^T's fragments directly, with no transposition. Two block barriers per tile.
//
// Softmax: online (running max) form in fp32, base-2 domain (scores scaled by scale * log2(e)
// after the fp32-accumulated mma); P is rounded to the cache's 16-bit type for the P.V mma while
// the denominator sums the fp32 probabilities (the rounding is within the tests' tolerance).
#include "kv_tile_gather.h"

namespace pagedkv {

constexpr int kMmaDecodeWarps = 4;
constexpr int kMmaDecodeThreads = kMmaDecodeWarps * 32;
constexpr int kMmaDecodeHeads = 8;  // mma's n: query heads per block, padded

template <int HEAD_DIM>
struct MmaDecodeShape {
  // Tokens per tile: 8 KiB of K and 8 KiB of V, as DecodeShape<16-bit T, HEAD_DIM>::kTileTokens.
  static constexpr int kTile = 4096 / HEAD_DIM;
  static constexpr int kTokenSteps = kTile / 16;                 // 16-token mma steps per tile
  static constexpr int kWarpDims = HEAD_DIM / kMmaDecodeWarps;   // head dims one warp owns in O^T
  static constexpr int kDimSteps = kWarpDims / 16;               // 16-dim mma steps of O^T per warp
  // Scores: warp w computes token step w % kTokenSteps over the dims of part w / kTokenSteps
  // (kScoreParts parts of kScoreDimSteps 16-dim steps), so the partial sums to add up are as few
  // as the tile allows (none at head_dim 64, 2 at 128, 4 at 256).
  static constexpr int kScoreParts = kMmaDecodeWarps / kTokenSteps;
  static constexpr int kScoreDimSteps = HEAD_DIM / kScoreParts / 16;
  static constexpr int kScoreStride = kTile + 4;                 // padded: conflict-free stores
  static_assert(HEAD_DIM % 64 == 0, "each warp owns whole 16-dim mma steps");
  static_assert(kTile % 16 == 0 && kTile >= 16, "tiles hold whole 16-token mma steps");
  static_assert(kMmaDecodeWarps % kTokenSteps == 0, "warps tile the token steps");
};

// grid: (num_kv_heads, num_seqs, num_splits); block: kMmaDecodeThreads threads.
// Arguments and outputs exactly as paged_decode_kernel's; group_size <= kMmaDecodeHeads.
// window > 0: the visible keys are [first, seq_len), first = max(0, seq_len - window). The tiles
// must start at a block boundary (or, for blocks longer than a tile, a tile boundary) for the
// staged page-table entries, so the key loop starts at `base`, `first` rounded down to
// min(BLOCK_SIZE, kTile): the first visible key's block. The rows of [base, first) are
// zero-filled without a read and masked; no table entry before first's block is read (it may be
// -1, a released block). Split s covers [base + s * tokens_per_split, ...).
template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(kMmaDecodeThreads) paged_decode_mma_kernel(
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
  using Shape = MmaDecodeShape<HEAD_DIM>;
  constexpr int kTile = Shape::kTile;
  constexpr int kRowHalves = PaddedRow<HEAD_DIM>::kHalves;
  alignas(16) __shared__ unsigned short k_sm[2][kTile][kRowHalves];
  alignas(16) __shared__ unsigned short v_sm[2][kTile][kRowHalves];
  // Partial scores over each part of the head dims, [part][head][token].
  alignas(16) __shared__ float score_sm[Shape::kScoreParts][kMmaDecodeHeads][Shape::kScoreStride];
  // Page-table entries of the blocks of tile i, in table_sm[i % 2]; a tile starts at a block
  // boundary (BLOCK_SIZE <= kTile, both powers of 2) or inside one block (BLOCK_SIZE > kTile).
  constexpr int kTableEntries = BLOCK_SIZE <= kTile ? kTile / BLOCK_SIZE : 1;
  static_assert(kTableEntries <= kMmaDecodeThreads, "one entry per thread");
  __shared__ int table_sm[2][kTableEntries];

  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int num_splits = gridDim.z;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int lane_group = lane >> 2;  // mma groupID: rows g, g + 8 of S^T (tokens) and O^T (dims); B column (head)
  const int tig = lane & 3;          // mma thread id in group: heads 2 tig, 2 tig + 1 of C
  const int num_q_heads = num_kv_heads * group_size;
  const int dim0 = warp * Shape::kWarpDims;  // this warp's dims of O^T
  const int score_step = warp % Shape::kTokenSteps;  // this warp's token step of S^T ...
  const int score_part = warp / Shape::kTokenSteps;  // ... over these dims
  const int score_dim0 = score_part * Shape::kScoreDimSteps * 16;

  const int seq_len = load_scalar(seq_lens + seq);
  constexpr int kAlign = BLOCK_SIZE < kTile ? BLOCK_SIZE : kTile;
  const int first = window > 0 ? max(0, seq_len - window) : 0;  // first visible key
  const int base = first - first % kAlign;
  const int begin = base + split * tokens_per_split;
  const int end = min(seq_len, begin + tokens_per_split);
  const unsigned int slot_bytes = static_cast<unsigned int>(num_kv_heads) * HEAD_DIM * sizeof(T);
  const T* k_head = k_cache + static_cast<i64>(kv_head) * HEAD_DIM;
  const T* v_head = v_cache + static_cast<i64>(kv_head) * HEAD_DIM;
  const int* table = block_tables + static_cast<i64>(seq) * max_blocks_per_seq;
  const i64 q_row0 = static_cast<i64>(seq) * num_q_heads + static_cast<i64>(kv_head) * group_size;

  // Splits must start on a kAlign boundary (the staged page-table entries above assume it), so
  // tokens_per_split is a positive multiple of kAlign. kernel_launch.check_decode_split refuses
  // anything else before a launch; a launch that bypasses it gets NaN (every row of this block;
  // with splits, NaN partial rows of weight 1, so the merge's output is NaN too), never a finite
  // wrong result.
  if (tokens_per_split <= 0 || tokens_per_split % kAlign != 0) {
    const float nan = __int_as_float(0x7fc00000);
    for (int i = tid; i < group_size * HEAD_DIM; i += kMmaDecodeThreads) {
      const i64 row = q_row0 + i / HEAD_DIM;
      if (num_splits == 1) {
        store_scalar(out + row * HEAD_DIM + i % HEAD_DIM, Kv<T>::from_float(nan));
      } else {
        store_scalar(split_out + (row * num_splits + split) * HEAD_DIM + i % HEAD_DIM, nan);
        if (i % HEAD_DIM == 0) {
          store_scalar(split_max + row * num_splits + split, 0.f);
          store_scalar(split_sum + row * num_splits + split, 1.f);
        }
      }
    }
    return;
  }

  // Page-table entries of a tile's blocks, staged in shared memory one tile ahead of its gather:
  // the entry loads leave the gather's dependency chain (table -> address -> copy), and each entry
  // is read from global memory once per block instead of once per 16-byte chunk.
  auto table_entry = [&](int tile) -> int {  // entry tid of the tile's blocks (0: none)
    const unsigned int block = static_cast<unsigned int>(tile) / BLOCK_SIZE + tid;
    return tile < end && block * BLOCK_SIZE < static_cast<unsigned int>(end) ? load_scalar(table + block) : 0;
  };
  auto load_tile = [&](int tile, int buf) {
    const int* entries = table_sm[buf];
    auto slot_of = [&](int token) -> unsigned int {
      const unsigned int offset = static_cast<unsigned int>(token - tile);  // tile starts at a block or inside one
      return static_cast<unsigned int>(entries[offset / BLOCK_SIZE]) * BLOCK_SIZE +
             static_cast<unsigned int>(token) % BLOCK_SIZE;
    };
    gather_kv_tile_async<T, HEAD_DIM, kTile, kMmaDecodeThreads>(k_sm[buf], v_sm[buf], k_head, v_head, slot_bytes,
                                                                 tile, first, end, tid, slot_of);
    cp_async_commit();
  };
  if (tid < kTableEntries) {
    table_sm[0][tid] = table_entry(begin);
    table_sm[1][tid] = table_entry(begin + kTile);
  }
  __syncthreads();
  if (begin < end) load_tile(begin, 0);

  // Q^T B fragments of this warp's score dims: head lane_group, dims 2 tig (+1) and 2 tig + 8
  // (+1) of each 16-dim step; zero for padding heads. Unscaled (the scale is applied to fp32 scores).
  unsigned int q_frag[Shape::kScoreDimSteps][2];
#pragma unroll
  for (int ks = 0; ks < Shape::kScoreDimSteps; ++ks) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      unsigned int word = 0u;
      if (lane_group < group_size) {
        const T* src = q + (q_row0 + lane_group) * HEAD_DIM + score_dim0 + ks * 16 + 2 * tig + 8 * r;
#if !defined(__CUDA_ARCH__)
        pkv_emu::check_access(src, 4, "q load");
#endif
        word = *reinterpret_cast<const word_alias*>(src);
      }
      q_frag[ks][r] = word;
    }
  }

  float o_acc[Shape::kDimSteps][4];  // O^T: dims dim0 + ks*16 + lane_group (+8), heads 2 tig (+1)
#pragma unroll
  for (int ks = 0; ks < Shape::kDimSteps; ++ks) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o_acc[ks][i] = 0.f;
  }
  float m_run = neg_inf();  // running max (log2 domain) of head lane_group
  float l_run = 0.f;        // this lane's share of head lane_group's running denominator

  int buf = 0;
  for (int tile = begin; tile < end; tile += kTile) {
    cp_async_wait<0>();
    // This tile has landed for every thread, and every thread is done with the previous tile
    // (its buffers, table entries and score_sm), so all may be overwritten now.
    __syncthreads();
    if (tile + kTile < end) load_tile(tile + kTile, buf ^ 1);
    // The entries of the tile after next: loaded now, stored after this tile's math.
    const int next_entry = tid < kTableEntries ? table_entry(tile + 2 * kTile) : 0;

    // 1. Partial S^T of this warp's token step over its score dims, into score_sm.
    {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < Shape::kScoreDimSteps; ++ks) {
        // x4: A fragment of the step's 16 tokens x 16 dims (row lane & 15, column half lane >> 4).
        unsigned int a[4];
        ldmatrix_x4(a, &k_sm[buf][score_step * 16 + (lane & 15)][score_dim0 + ks * 16 + (lane >> 4) * 8]);
        mma_16816<T>(c, a, q_frag[ks], c);
      }
      float* part = &score_sm[score_part][0][0];
      const int token = score_step * 16 + lane_group;
      part[(2 * tig) * Shape::kScoreStride + token] = c[0];
      part[(2 * tig + 1) * Shape::kScoreStride + token] = c[1];
      part[(2 * tig) * Shape::kScoreStride + token + 8] = c[2];
      part[(2 * tig + 1) * Shape::kScoreStride + token + 8] = c[3];
    }
    __syncthreads();

    // 2. Online softmax of head lane_group over the tile, in the B-fragment layout of P^T: this
    //    lane's tokens of 16-token step kk are kk*16 + 2 tig (+1) and kk*16 + 2 tig + 8 (+1).
    float p[Shape::kTokenSteps][4];
    float tile_max = neg_inf();
#pragma unroll
    for (int kk = 0; kk < Shape::kTokenSteps; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int token = kk * 16 + 2 * tig + (i & 1) + 8 * (i >> 1);
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < Shape::kScoreParts; ++w) s += score_sm[w][lane_group][token];
        s = tile + token < end && tile + token >= first ? s * scale_log2 : neg_inf();
        p[kk][i] = s;
        tile_max = fmaxf(tile_max, s);
      }
    }
    // The 4 lanes of a group hold the tile's tokens of one head between them.
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    // Every tile has a visible token (its first, or `first` itself in the first tile of split 0),
    // so m_new is finite.
    const float m_new = fmaxf(m_run, tile_max);
    const float alpha = exp2f(m_run - m_new);
    m_run = m_new;
    l_run *= alpha;
#pragma unroll
    for (int kk = 0; kk < Shape::kTokenSteps; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        p[kk][i] = exp2f(p[kk][i] - m_new);
        l_run += p[kk][i];
      }
    }

    // 3. Rescale O^T: its columns are heads 2 tig and 2 tig + 1, whose alpha lanes 8 tig and
    //    8 tig + 4 (groups 2 tig, 2 tig + 1) computed.
    const float alpha0 = __shfl_sync(0xffffffffu, alpha, 8 * tig);
    const float alpha1 = __shfl_sync(0xffffffffu, alpha, 8 * tig + 4);
#pragma unroll
    for (int ks = 0; ks < Shape::kDimSteps; ++ks) {
      o_acc[ks][0] *= alpha0;
      o_acc[ks][1] *= alpha1;
      o_acc[ks][2] *= alpha0;
      o_acc[ks][3] *= alpha1;
    }

    // 4. O^T += V^T P^T over the tile, 16 tokens per step.
#pragma unroll
    for (int kk = 0; kk < Shape::kTokenSteps; ++kk) {
      const unsigned int b[2] = {pack2<T>(p[kk][0], p[kk][1]), pack2<T>(p[kk][2], p[kk][3])};
      const int m = lane >> 3;  // the ldmatrix matrix this lane addresses: token half m >> 1, dim half m & 1
#pragma unroll
      for (int ks = 0; ks < Shape::kDimSteps; ++ks) {
        unsigned int a[4];
        ldmatrix_x4_trans(a, &v_sm[buf][kk * 16 + (m >> 1) * 8 + (lane & 7)][dim0 + ks * 16 + (m & 1) * 8]);
        mma_16816<T>(o_acc[ks], a, b, o_acc[ks]);
      }
    }
    if (tid < kTableEntries) table_sm[buf][tid] = next_entry;  // read by the gather of the next iteration
    buf ^= 1;
  }

  // Denominator of head lane_group over its 4 lanes; then those of this lane's O^T columns.
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  float col_sum[2];
  float col_max[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    col_sum[h] = __shfl_sync(0xffffffffu, l_run, 8 * tig + 4 * h);
    col_max[h] = __shfl_sync(0xffffffffu, m_run, 8 * tig + 4 * h);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int g = 2 * tig + h;
    if (g >= group_size) continue;
    const float denom = col_sum[h];
    const float inv = denom > 0.f ? 1.f / denom : 0.f;
    const i64 row = q_row0 + g;
#pragma unroll
    for (int ks = 0; ks < Shape::kDimSteps; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = dim0 + ks * 16 + lane_group + 8 * half;
        const float value = o_acc[ks][2 * half + h] * inv;
        if (num_splits == 1) {
          store_scalar(out + row * HEAD_DIM + d, Kv<T>::from_float(value));
        } else {
          store_scalar(split_out + (row * num_splits + split) * HEAD_DIM + d, value);
        }
      }
    }
    if (num_splits > 1 && warp == 0 && lane_group == 0) {
      const i64 part = row * num_splits + split;
      store_scalar(split_max + part, col_max[h]);
      store_scalar(split_sum + part, denom);
    }
  }
}

}  // namespace pagedkv
