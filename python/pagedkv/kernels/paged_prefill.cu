// Paged prefill attention on tensor cores: every new query token of every sequence attends
// (causally) to its sequence's keys and values, which live in fixed-size blocks of a shared cache
// found through a page table. One launch covers whole prompts, prefix-hit suffixes, chunks of a
// chunked prefill and decode rows (one query) side by side.
//
// Algorithm: FlashAttention-2's forward pass. A thread block owns one KV head and a tile of
// kRows "packed rows" of one sequence, where packed row r is query token r / group of query head
// r % group (GQA packing, as FlashInfer does): the group's query heads share every K/V tile, and a
// decode row with group 8 still fills half of a 16-row mma tile. Each of the kWarps warps owns 16
// rows. K/V tiles of kKv tokens are gathered through the page table into shared memory with
// cp.async (double-buffered: the next tile streams in while the current one is used), read into
// mma fragments with ldmatrix (.trans for V), S = Q K^T and O += P V run on mma.sync m16n8k16 with
// fp32 accumulation, and the softmax is the online (running max) form in the base-2 domain.
// P goes from the S accumulator straight into A fragments (the C layout of one m16n8 pair is
// the A layout of m16n8k16), so it never touches shared memory. Causal masking stops the loop at
// the tile's last visible key and masks inside the diagonal tiles.
//
// Shared-memory rows are padded by 16 bytes so the 8 row addresses of one ldmatrix fall in
// distinct banks.
#include "kv_tile_gather.h"

namespace pagedkv {

constexpr int kPrefillWarps = 4;
constexpr int kPrefillThreads = kPrefillWarps * 32;
constexpr int kPrefillRows = kPrefillWarps * 16;  // packed rows per thread block

template <int HEAD_DIM>
struct PrefillShape {
  // Tokens per K/V tile: K and V, double-buffered, stay under 48 KiB of static shared memory.
  static constexpr int kKv = HEAD_DIM <= 64 ? 64 : 32;
  static constexpr int kRowHalves = PaddedRow<HEAD_DIM>::kHalves;  // padded shared-memory row
  static constexpr int kChunksPerRow = PaddedRow<HEAD_DIM>::kChunks;  // 16-byte chunks in one token's row
  static constexpr int kDimTiles = HEAD_DIM / 8;   // n-tiles of O
  static constexpr int kKeyTiles = kKv / 8;        // n-tiles of S
  static_assert(HEAD_DIM % 32 == 0, "head_dim must be a multiple of 32");
  static_assert(kKv * kChunksPerRow % kPrefillThreads == 0, "threads must tile a K/V tile");
  static_assert(kKv % 16 == 0, "K/V tiles hold whole 16-key mma steps");
  static_assert(2 * 2 * kKv * kRowHalves * 2 <= 48 * 1024, "static shared memory");
};

// grid: (num_work_tiles, num_kv_heads); block: kPrefillThreads threads.
// Work tile w covers packed rows [tile_row0[w], tile_row0[w] + kPrefillRows) of sequence
// tile_seq[w] (rows past q_len * group are padding) over keys [tile_split[w] * tokens_per_split,
// + tokens_per_split) of the keys those rows need. With one split it writes `out`; otherwise
// (split-KV: few query rows over long contexts, so the grid still fills the GPU) it writes a
// normalised partial result into partial slot tile_partial[w], which merge_prefill_splits_kernel
// combines. Sequence b's page table row starts at
// page_indices + page_row_start[b]; its logical block j holds tokens [j * BLOCK_SIZE, ...).
template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_kernel(
    T* __restrict__ out,                       // [total_q, num_q_heads, HEAD_DIM]
    const T* __restrict__ q,                   // [total_q, num_q_heads, HEAD_DIM]
    const T* __restrict__ k_cache,             // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    const T* __restrict__ v_cache,             // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    const int* __restrict__ page_indices,      // [num_entries] physical block ids
    const int* __restrict__ page_row_start,    // [num_seqs] offset of each sequence's row
    const int* __restrict__ seq_lens,          // [num_seqs] whole context incl. the new tokens
    const int* __restrict__ query_start_loc,   // [num_seqs + 1]
    const int* __restrict__ tile_seq,          // [num_work_tiles]
    const int* __restrict__ tile_row0,         // [num_work_tiles]
    const int* __restrict__ tile_split,        // [num_work_tiles] which KV split of its rows
    const int* __restrict__ tile_partial,      // [num_work_tiles] partial slot, -1: write `out`
    float* __restrict__ split_out,             // [num_partials, num_kv_heads, kPrefillRows, HEAD_DIM]
    float* __restrict__ split_ml,              // [num_partials, num_kv_heads, kPrefillRows, 2]
    int num_kv_heads, int group, int causal, int tokens_per_split, float scale_log2, int window) {
  using Shape = PrefillShape<HEAD_DIM>;
  constexpr int kKv = Shape::kKv;
  constexpr int kRowHalves = Shape::kRowHalves;
  alignas(16) __shared__ unsigned short k_sm[2][kKv][kRowHalves];
  alignas(16) __shared__ unsigned short v_sm[2][kKv][kRowHalves];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int lane_group = lane >> 2;  // mma groupID
  const int tig = lane & 3;          // mma thread id in group
  const int kv_head = blockIdx.y;
  const int seq = tile_seq[blockIdx.x];
  const int row0 = tile_row0[blockIdx.x];
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int seq_len = seq_lens[seq];
  const int first_pos = seq_len - q_len;  // position of the sequence's first new token
  const int num_q_heads = num_kv_heads * group;
  const int* table = page_indices + page_row_start[seq];
  const unsigned int slot_bytes = static_cast<unsigned int>(num_kv_heads) * HEAD_DIM * sizeof(T);
  const T* k_head = k_cache + static_cast<i64>(kv_head) * HEAD_DIM;
  const T* v_head = v_cache + static_cast<i64>(kv_head) * HEAD_DIM;

  // Keys this tile needs: all of them, or (causal) up to its last row's position, and (causal with
  // a sliding window > 0) from its first row's first visible key kv_first on; of those, this work
  // tile's split [kv_begin, kv_end). Keys are gathered one row at a time, so the loop starts at
  // kv_first itself: no key before it, nor its page-table entry (-1 for a released block), is read.
  const int last_token = min(q_len - 1, (row0 + kPrefillRows - 1) / group);
  const int kv_needed = causal ? min(seq_len, first_pos + last_token + 1) : seq_len;
  const bool windowed = causal && window > 0;
  const int kv_first = windowed ? max(0, first_pos + row0 / group - window + 1) : 0;
  const int kv_begin = kv_first + tile_split[blockIdx.x] * tokens_per_split;
  const int kv_end = min(kv_needed, kv_begin + tokens_per_split);
  const int partial = tile_partial[blockIdx.x];

  // This lane's two rows of the warp's 16: packed rows row0 + warp * 16 + lane_group (+ 8).
  int row_token[2];
  int row_head[2];
  bool row_valid[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + warp * 16 + lane_group + 8 * h;
    row_token[h] = r / group;
    row_head[h] = kv_head * group + r % group;
    row_valid[h] = row_token[h] < q_len;
  }

  // Q fragments straight from global memory (read once per block), zero for padding rows.
  unsigned int q_frag[HEAD_DIM / 16][4];
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int h = r & 1;  // a0/a2: row lane_group, a1/a3: row lane_group + 8
      const int col = kk * 16 + 2 * tig + 8 * (r >> 1);
      unsigned int word = 0u;
      if (row_valid[h]) {
        const T* src = q + (static_cast<i64>(q_start + row_token[h]) * num_q_heads + row_head[h]) * HEAD_DIM + col;
        word = *reinterpret_cast<const word_alias*>(src);
      }
      q_frag[kk][r] = word;
    }
  }

  // Gathers K/V tokens [tile, tile + kKv) into buffer `buf`; tokens past kv_end are zero-filled.
  auto load_tile = [&](int tile, int buf) {
    auto slot_of = [&](int t) -> unsigned int {
      return static_cast<unsigned int>(table[t / BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE;
    };
    gather_kv_tile_async<T, HEAD_DIM, kKv, kPrefillThreads>(k_sm[buf], v_sm[buf], k_head, v_head, slot_bytes, tile,
                                                            tile, kv_end, tid, slot_of);
    cp_async_commit();
  };

  float o_acc[Shape::kDimTiles][4];
#pragma unroll
  for (int n = 0; n < Shape::kDimTiles; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o_acc[n][i] = 0.f;
  }
  float m_run[2] = {neg_inf(), neg_inf()};  // running max (log2 domain) of rows lane_group, +8
  float l_run[2] = {0.f, 0.f};              // this lane's share of the running denominators

  // Each row's visible keys [key_lo, key_hi]: from its window's first key (window) to the
  // split's end and (causal) its own position; two compares per score in the loop.
  int key_lo[2];
  int key_hi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pos = first_pos + row_token[h];
    key_lo[h] = windowed ? pos - window + 1 : 0;
    key_hi[h] = causal ? min(kv_end - 1, pos) : kv_end - 1;
  }

  if (kv_begin < kv_end) load_tile(kv_begin, 0);
  int buf = 0;
  for (int tile = kv_begin; tile < kv_end; tile += kKv) {
    if (tile + kKv < kv_end) {
      load_tile(tile + kKv, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // every thread's part of this tile has landed

    // S = Q K^T for this warp's 16 rows and the tile's kKv keys.
    float s[Shape::kKeyTiles][4];
#pragma unroll
    for (int j = 0; j < Shape::kKeyTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = 0.f;
#pragma unroll
      for (int kk = 0; kk < HEAD_DIM / 16; kk += 2) {
        // x4: B fragments of k-steps kk and kk + 1 for keys j*8..j*8+7.
        unsigned int b[4];
        ldmatrix_x4(b, &k_sm[buf][j * 8 + (lane & 7)][kk * 16 + (lane >> 3) * 8]);
        const unsigned int b0[2] = {b[0], b[1]};
        const unsigned int b1[2] = {b[2], b[3]};
        mma_16816<T>(s[j], q_frag[kk], b0, s[j]);
        mma_16816<T>(s[j], q_frag[kk + 1], b1, s[j]);
      }
    }

    // Scale into the log2 domain and mask keys past the context, (causal) past the row, and
    // (window) before the row's first visible key; the tile's later rows see fewer early keys.
    float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int j = 0; j < Shape::kKeyTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int h = i >> 1;
        const int key = tile + j * 8 + 2 * tig + (i & 1);
        const bool visible = key >= key_lo[h] && key <= key_hi[h];
        s[j][i] = visible ? s[j][i] * scale_log2 : neg_inf();
        tile_max[h] = fmaxf(tile_max[h], s[j][i]);
      }
    }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // The 4 lanes of a group hold one row between them.
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
      const float m_new = fmaxf(m_run[h], tile_max[h]);
      // A row with no visible key yet keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
      const float m_use = m_new == neg_inf() ? 0.f : m_new;
      alpha[h] = exp2f(m_run[h] - m_use);
      m_run[h] = m_new;
      l_run[h] *= alpha[h];
#pragma unroll
      for (int j = 0; j < Shape::kKeyTiles; ++j) {
        s[j][2 * h] = exp2f(s[j][2 * h] - m_use);
        s[j][2 * h + 1] = exp2f(s[j][2 * h + 1] - m_use);
        l_run[h] += s[j][2 * h] + s[j][2 * h + 1];
      }
    }
#pragma unroll
    for (int n = 0; n < Shape::kDimTiles; ++n) {
      o_acc[n][0] *= alpha[0];
      o_acc[n][1] *= alpha[0];
      o_acc[n][2] *= alpha[1];
      o_acc[n][3] *= alpha[1];
    }

    // O += P V, 16 keys per step; P's A fragments come from two n-tiles of S.
#pragma unroll
    for (int kk = 0; kk < kKv / 16; ++kk) {
      const unsigned int p[4] = {
          pack2<T>(s[2 * kk][0], s[2 * kk][1]),
          pack2<T>(s[2 * kk][2], s[2 * kk][3]),
          pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
          pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]),
      };
#pragma unroll
      for (int n = 0; n < Shape::kDimTiles; n += 2) {
        // x4.trans: B fragments of dim tiles n and n + 1 for keys kk*16..kk*16+15.
        unsigned int b[4];
        const int m = lane >> 3;
        ldmatrix_x4_trans(b, &v_sm[buf][kk * 16 + (m & 1) * 8 + (lane & 7)][(n + (m >> 1)) * 8]);
        const unsigned int b0[2] = {b[0], b[1]};
        const unsigned int b1[2] = {b[2], b[3]};
        mma_16816<T>(o_acc[n], p, b0, o_acc[n]);
        mma_16816<T>(o_acc[n + 1], p, b1, o_acc[n + 1]);
      }
    }
    __syncthreads();  // the whole block is done with `buf` before it is refilled
    buf ^= 1;
  }

  // Sum the row denominators over the 4 lanes of each group, normalise, store.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!row_valid[h]) continue;
    const float inv = l_run[h] > 0.f ? 1.f / l_run[h] : 0.f;
    if (partial < 0) {
      T* dst = out + (static_cast<i64>(q_start + row_token[h]) * num_q_heads + row_head[h]) * HEAD_DIM;
#pragma unroll
      for (int n = 0; n < Shape::kDimTiles; ++n) {
        const int col = n * 8 + 2 * tig;
        dst[col] = Kv<T>::from_float(o_acc[n][2 * h] * inv);
        dst[col + 1] = Kv<T>::from_float(o_acc[n][2 * h + 1] * inv);
      }
    } else {
      // One split of several: the normalised partial output, its max and its denominator.
      const int local_row = warp * 16 + lane_group + 8 * h;
      const i64 slot = (static_cast<i64>(partial) * num_kv_heads + kv_head) * kPrefillRows + local_row;
      float* dst = split_out + slot * HEAD_DIM;
#pragma unroll
      for (int n = 0; n < Shape::kDimTiles; ++n) {
        const int col = n * 8 + 2 * tig;
        dst[col] = o_acc[n][2 * h] * inv;
        dst[col + 1] = o_acc[n][2 * h + 1] * inv;
      }
      if (tig == 0) {
        split_ml[2 * slot] = m_run[h];
        split_ml[2 * slot + 1] = l_run[h];
      }
    }
  }
}

// grid: (num_merge_tiles, num_kv_heads); block: kPrefillThreads threads.
// Merge tile i combines the merge_num_splits[i] partial results (slots merge_first[i], ...) of the
// packed rows [merge_row0[i], + kPrefillRows) of sequence merge_seq[i]: each split weighs in with
// its denominator rescaled to the rows' common max (a split with no visible key weighs 0).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kPrefillThreads) merge_prefill_splits_kernel(
    T* __restrict__ out,                      // [total_q, num_q_heads, HEAD_DIM]
    const float* __restrict__ split_out,      // [num_partials, num_kv_heads, kPrefillRows, HEAD_DIM]
    const float* __restrict__ split_ml,       // [num_partials, num_kv_heads, kPrefillRows, 2]
    const int* __restrict__ query_start_loc,  // [num_seqs + 1]
    const int* __restrict__ merge_seq,        // [num_merge_tiles]
    const int* __restrict__ merge_row0,       // [num_merge_tiles]
    const int* __restrict__ merge_first,      // [num_merge_tiles] first partial slot
    const int* __restrict__ merge_num_splits, // [num_merge_tiles]
    int num_kv_heads, int group) {
  const int kv_head = blockIdx.y;
  const int seq = merge_seq[blockIdx.x];
  const int row0 = merge_row0[blockIdx.x];
  const int first = merge_first[blockIdx.x];
  const int splits = merge_num_splits[blockIdx.x];
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int num_q_heads = num_kv_heads * group;
  for (int idx = threadIdx.x; idx < kPrefillRows * HEAD_DIM; idx += kPrefillThreads) {
    const int local_row = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    const int r = row0 + local_row;
    const int token = r / group;
    if (token >= q_len) continue;
    float m = neg_inf();
    for (int s = 0; s < splits; ++s) {
      const i64 slot = (static_cast<i64>(first + s) * num_kv_heads + kv_head) * kPrefillRows + local_row;
      m = fmaxf(m, split_ml[2 * slot]);
    }
    float total = 0.f;
    float acc = 0.f;
    for (int s = 0; s < splits; ++s) {
      const i64 slot = (static_cast<i64>(first + s) * num_kv_heads + kv_head) * kPrefillRows + local_row;
      const float ms = split_ml[2 * slot];
      const float w = ms == neg_inf() ? 0.f : split_ml[2 * slot + 1] * exp2f(ms - m);
      total += w;
      if (w > 0.f) acc += w * split_out[slot * HEAD_DIM + d];
    }
    const int head = kv_head * group + r % group;
    out[(static_cast<i64>(q_start + token) * num_q_heads + head) * HEAD_DIM + d] =
        Kv<T>::from_float(total > 0.f ? acc / total : 0.f);
  }
}

}  // namespace pagedkv
