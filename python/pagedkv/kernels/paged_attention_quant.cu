// Paged attention on quantized KV caches (int8, fp8 e4m3, int4): decode and prefill in one kernel,
// dequantizing on read.
//
// Work split: like the tensor-core prefill kernel, a thread block owns one KV head and a tile of
// kQuantRows "packed rows" of one sequence (row r = query token r / group of query head r % group),
// so a decode row of up to 8 query heads is one tile and the group's heads share every K/V tile
// read. Keys and values are read a tile of kTile tokens at a time, dequantized into shared memory
// in fp32 (sealed blocks through the format's traits in kv_quant.h; an int4 sequence's open last
// block from its residual slot), then S = Q K^T, the online softmax (base-2 domain, fp32) and
// O += P V run on CUDA cores. Long contexts are cut into splits along the keys, each writing a
// normalized partial output that merge_splits_kernel (paged_attention.cu) combines; a split whose
// keys a row cannot see writes max -inf and denominator 0, which the merge weighs 0.
//
// Why CUDA cores and a shared-memory staging tile rather than the fp16 kernels' register pipelines:
// the dequantization (a scale per token-head, int4 metadata per group) is the new part, and one
// simple kernel for both decode and prefill keeps it in one place. docs/quantized_kv.md, "Kernels".
#include "kv_quant.h"

namespace pagedkv {

constexpr int kQuantThreads = 128;
constexpr int kQuantRows = 16;  // packed (query token, head) rows per thread block

template <int HEAD_DIM>
struct QuantShape {
  // K and V tiles of kTile tokens: 8 KiB each in fp32, whatever the head size.
  static constexpr int kTile = 2048 / HEAD_DIM;
  static constexpr int kAcc = kQuantRows * HEAD_DIM / kQuantThreads;  // output elements per thread
  static_assert(kQuantRows * HEAD_DIM % kQuantThreads == 0, "threads must tile the output rows");
};

// grid: (num_tiles, num_kv_heads, num_splits); block: kQuantThreads threads.
// Tile w covers packed rows [tile_row0[w], + kQuantRows) of sequence tile_seq[w] (rows past
// q_len * group are padding). Sequence b's queries are its last q_len = query_start_loc[b + 1] -
// query_start_loc[b] positions; its logical block j holds tokens [j * block_size, ...) and is
// physical block page_indices[page_row_start[b] + j]. With Fmt::kResidual (int4), the tokens past
// the last full block (seq_len / block_size * block_size) are read from residual slot
// residual_slots[b]. causal: a query at position p sees keys <= p; window > 0 (causal only): keys
// >= p - window + 1. Split s covers the tile's keys [first + s * tokens_per_split, ...), first
// being the tile's first row's first visible key; keys before it (and their page-table entries,
// -1 for a released block) are never read.
template <typename T, typename Fmt, int HEAD_DIM>
__global__ void __launch_bounds__(kQuantThreads) paged_attention_quant_kernel(
    T* __restrict__ out,                        // [total_q, num_q_heads, HEAD_DIM]
    float* __restrict__ split_out,              // [total_q, num_q_heads, num_splits, HEAD_DIM]
    float* __restrict__ split_max,              // [total_q, num_q_heads, num_splits] (log2 domain)
    float* __restrict__ split_sum,              // [total_q, num_q_heads, num_splits]
    const T* __restrict__ q,                    // [total_q, num_q_heads, HEAD_DIM]
    const unsigned char* __restrict__ k_data,   // [num_blocks, k_block_bytes]
    const unsigned char* __restrict__ v_data,   // [num_blocks, v_block_bytes]
    const unsigned char* __restrict__ k_residual,  // [num_residual_slots, residual_block_bytes] (int4: int8 blocks)
    const unsigned char* __restrict__ v_residual,  // [num_residual_slots, residual_block_bytes] (int4: int8 blocks)
    const int* __restrict__ page_indices,       // [num_entries] physical block ids
    const int* __restrict__ page_row_start,     // [num_seqs]
    const int* __restrict__ seq_lens,           // [num_seqs] whole context, new tokens included
    const int* __restrict__ query_start_loc,    // [num_seqs + 1]
    const int* __restrict__ residual_slots,     // [num_seqs] (int4)
    const int* __restrict__ tile_seq,           // [num_tiles]
    const int* __restrict__ tile_row0,          // [num_tiles]
    int num_kv_heads, int group, int block_size, int causal, int tokens_per_split, float scale_log2,
    int window, i64 k_block_bytes, i64 v_block_bytes, i64 k_meta_offset, i64 v_meta_offset,
    i64 k_side_offset, i64 v_side_offset, i64 residual_block_bytes, i64 residual_meta_offset) {
  using Shape = QuantShape<HEAD_DIM>;
  constexpr int kTile = Shape::kTile;
  __shared__ float q_sm[kQuantRows][HEAD_DIM];  // pre-scaled into the log2 domain
  __shared__ float k_sm[kTile][HEAD_DIM];
  __shared__ float v_sm[kTile][HEAD_DIM];
  __shared__ float p_sm[kQuantRows][kTile];  // scores, then probabilities
  __shared__ float alpha_sm[kQuantRows];
  __shared__ float m_sm[kQuantRows];
  __shared__ float l_sm[kQuantRows];

  const int tid = threadIdx.x;
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int num_splits = gridDim.z;
  const int seq = load_scalar(tile_seq + blockIdx.x);
  const int row0 = load_scalar(tile_row0 + blockIdx.x);
  const int q_start = load_scalar(query_start_loc + seq);
  const int q_len = load_scalar(query_start_loc + seq + 1) - q_start;
  const int seq_len = load_scalar(seq_lens + seq);
  const int first_pos = seq_len - q_len;
  const int num_q_heads = num_kv_heads * group;
  const int* table = page_indices + load_scalar(page_row_start + seq);
  const int sealed_end = Fmt::kResidual ? seq_len / block_size * block_size : seq_len;
  const int res_slot = (Fmt::kResidual && sealed_end < seq_len) ? load_scalar(residual_slots + seq) : 0;

  const int last_token = min(q_len - 1, (row0 + kQuantRows - 1) / group);
  const int kv_needed = causal ? min(seq_len, first_pos + last_token + 1) : seq_len;
  const bool windowed = causal && window > 0;
  const int kv_first = windowed ? max(0, first_pos + row0 / group - window + 1) : 0;
  const int kv_begin = kv_first + split * tokens_per_split;
  const int kv_end = min(kv_needed, kv_begin + tokens_per_split);

  // A packed row's query: its token (within the sequence's queries), head and visible keys.
  auto row_token = [&](int r) { return (row0 + r) / group; };
  auto row_valid = [&](int r) { return row_token(r) < q_len; };

  for (int i = tid; i < kQuantRows * HEAD_DIM; i += kQuantThreads) {
    const int r = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    float x = 0.f;
    if (row_valid(r)) {
      const int head = kv_head * group + (row0 + r) % group;
      x = Kv<T>::to_float(load_scalar(q + (static_cast<i64>(q_start + row_token(r)) * num_q_heads + head) * HEAD_DIM + d)) *
          scale_log2;
    }
    q_sm[r][d] = x;
  }
  if (tid < kQuantRows) {
    m_sm[tid] = neg_inf();
    l_sm[tid] = 0.f;
  }
  float acc[Shape::kAcc];
#pragma unroll
  for (int i = 0; i < Shape::kAcc; ++i) acc[i] = 0.f;

  // One element of a key (or value) token: sealed blocks dequantized, the open block from the residual.
  auto load_kv = [&](bool is_key, int token, int d) -> float {
    if (token < sealed_end) {
      const i64 block = load_scalar(table + token / block_size);
      const unsigned char* base = (is_key ? k_data : v_data) + block * (is_key ? k_block_bytes : v_block_bytes);
      return Fmt::template load<HEAD_DIM>(base, token % block_size, kv_head, d, num_kv_heads,
                                          is_key ? k_meta_offset : v_meta_offset,
                                          is_key ? k_side_offset : v_side_offset, is_key);
    }
    // The open block: residual slot res_slot, an int8 block (the residual layout).
    const unsigned char* slot = (is_key ? k_residual : v_residual) + static_cast<i64>(res_slot) * residual_block_bytes;
    return QuantInt8::load<HEAD_DIM>(slot, token % block_size, kv_head, d, num_kv_heads, residual_meta_offset, 0, is_key);
  };

  for (int tile = kv_begin; tile < kv_end; tile += kTile) {
    __syncthreads();  // q_sm/m_sm ready (first tile); the previous tile's readers are done
    for (int i = tid; i < kTile * HEAD_DIM; i += kQuantThreads) {
      const int t = i / HEAD_DIM;
      const int d = i % HEAD_DIM;
      const int token = tile + t;
      // Past kv_end nothing is read (unused slots may hold anything, NaN included): zeros.
      k_sm[t][d] = token < kv_end ? load_kv(true, token, d) : 0.f;
      v_sm[t][d] = token < kv_end ? load_kv(false, token, d) : 0.f;
    }
    __syncthreads();

    // Scores of every (row, key) pair the row can see; -inf elsewhere.
    for (int i = tid; i < kQuantRows * kTile; i += kQuantThreads) {
      const int r = i / kTile;
      const int t = i % kTile;
      const int key = tile + t;
      float s = neg_inf();
      if (row_valid(r) && key < kv_end) {
        const int pos = first_pos + row_token(r);
        const bool visible = (!causal || key <= pos) && (!windowed || key >= pos - window + 1);
        if (visible) {
          float dot = 0.f;
          for (int d = 0; d < HEAD_DIM; ++d) dot = fmaf(q_sm[r][d], k_sm[t][d], dot);
          s = dot;
        }
      }
      p_sm[r][t] = s;
    }
    __syncthreads();

    // Online softmax, a thread per row: new max, rescale factor, probabilities, denominator.
    if (tid < kQuantRows) {
      const float m_old = m_sm[tid];
      float m_new = m_old;
      for (int t = 0; t < kTile; ++t) m_new = fmaxf(m_new, p_sm[tid][t]);
      // A row with no visible key yet keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
      const float m_use = m_new == neg_inf() ? 0.f : m_new;
      float sum = 0.f;
      for (int t = 0; t < kTile; ++t) {
        const float p = exp2f(p_sm[tid][t] - m_use);
        p_sm[tid][t] = p;
        sum += p;
      }
      const float alpha = exp2f(m_old - m_use);
      l_sm[tid] = l_sm[tid] * alpha + sum;
      m_sm[tid] = m_new;
      alpha_sm[tid] = alpha;
    }
    __syncthreads();

#pragma unroll
    for (int i = 0; i < Shape::kAcc; ++i) {
      const int e = tid + i * kQuantThreads;
      const int r = e / HEAD_DIM;
      const int d = e % HEAD_DIM;
      float a = acc[i] * alpha_sm[r];
      for (int t = 0; t < kTile; ++t) a = fmaf(p_sm[r][t], v_sm[t][d], a);
      acc[i] = a;
    }
  }
  __syncthreads();  // m_sm/l_sm final (also when no tile ran)

#pragma unroll
  for (int i = 0; i < Shape::kAcc; ++i) {
    const int e = tid + i * kQuantThreads;
    const int r = e / HEAD_DIM;
    const int d = e % HEAD_DIM;
    if (!row_valid(r)) continue;
    const int head = kv_head * group + (row0 + r) % group;
    const i64 row = static_cast<i64>(q_start + row_token(r)) * num_q_heads + head;
    const float denom = l_sm[r];
    const float value = denom > 0.f ? acc[i] / denom : 0.f;
    if (num_splits == 1) {
      store_scalar(out + row * HEAD_DIM + d, Kv<T>::from_float(value));
    } else {
      const i64 part = row * num_splits + split;
      store_scalar(split_out + part * HEAD_DIM + d, value);
      if (d == 0) {
        store_scalar(split_max + part, m_sm[r]);
        store_scalar(split_sum + part, denom);
      }
    }
  }
}

}  // namespace pagedkv
