// Writes into quantized KV caches: quantize each new token's heads into its slot (8-bit formats,
// and the int8 residual slots of int4 caches), and seal int4 blocks (quantize a whole block once
// it has filled: keys per channel over the block's tokens, values per token). The definition of every code is
// python/pagedkv/attention/quant_codec.py; these kernels reproduce it bit for bit.
#include "kv_quant.h"

namespace pagedkv {

constexpr int kQuantizeThreads = 128;  // four warps: a warp per (token, head)
constexpr int kSealThreads = 128;
constexpr int kMaxSealBlockSize = 32;  // the largest compiled block size (instances.BLOCK_SIZES)

// grid: (num_tokens, ceil(num_kv_heads / 4), 2); block: kQuantizeThreads threads.
// Warp w of block (t, y, z) quantizes head y * 4 + w of token t's keys (z = 0) or values (z = 1)
// into slot slot_mapping[t] (-1: skipped): HEAD_DIM one-byte codes and the UE5M3 scale of the
// row's absolute maximum (0xFF when the row holds a NaN or an infinity; its codes are then 0).
template <typename T, typename Fmt, int HEAD_DIM>
__global__ void __launch_bounds__(kQuantizeThreads) quantize_kv_kernel(
    unsigned char* __restrict__ k_data,   // [num_blocks, block_bytes]
    unsigned char* __restrict__ v_data,   // [num_blocks, block_bytes]
    const T* __restrict__ k,              // [num_tokens, num_kv_heads, HEAD_DIM]
    const T* __restrict__ v,              // [num_tokens, num_kv_heads, HEAD_DIM]
    const i64* __restrict__ slot_mapping,  // [num_tokens]
    int num_kv_heads, int block_size, i64 block_bytes, i64 meta_offset) {
  static_assert(HEAD_DIM % 32 == 0, "a lane holds whole elements");
  constexpr int kPerLane = HEAD_DIM / 32;
  const int lane = threadIdx.x & 31;
  const int head = blockIdx.y * (kQuantizeThreads / 32) + (threadIdx.x >> 5);
  const i64 token = blockIdx.x;
  if (head >= num_kv_heads) return;  // a whole warp leaves together: its shuffles stay full
  const i64 slot = load_scalar(slot_mapping + token);
  if (slot < 0) return;
  const T* src = (blockIdx.z == 0 ? k : v) + (token * num_kv_heads + head) * HEAD_DIM;
  unsigned char* block = (blockIdx.z == 0 ? k_data : v_data) + (slot / block_size) * block_bytes;
  const i64 row = (slot % block_size) * num_kv_heads + head;
  float x[kPerLane];
  float amax = 0.f;
  float bad = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    x[i] = Kv<T>::to_float(load_scalar(src + lane + 32 * i));
    amax = fmaxf(amax, fabsf(x[i]));
    bad = is_finite_float(x[i]) ? bad : 1.f;
  }
  amax = warp_max(amax);
  bad = warp_max(bad);
  const unsigned int scale = ue5m3_scale_for<Fmt::kMaxCode, Fmt::kPowerOfTwoScale>(amax, bad != 0.f);
  const float divisor = scale == 0xffu ? 1.f : ue5m3_to_float(scale);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    // x / s correctly rounded (the reference's float32 division), whatever the compile flags.
    const unsigned int code = scale == 0xffu ? 0u : Fmt::encode(__fdiv_rn(x[i], divisor));
    store_scalar(block + row * HEAD_DIM + lane + 32 * i, static_cast<unsigned char>(code));
  }
  if (lane == 0) store_scalar(block + meta_offset + row, static_cast<unsigned char>(scale));
}

// The block-wide min or max of one value per thread (every thread gets it). red_sm: 4 floats.
template <bool kMax>
__device__ __forceinline__ float block_extreme(float x, float* red_sm) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, x, offset);
    x = kMax ? fmaxf(x, other) : fminf(x, other);
  }
  __syncthreads();  // red_sm free (an earlier reduction's readers are done)
  if ((threadIdx.x & 31) == 0) red_sm[threadIdx.x >> 5] = x;
  __syncthreads();
  float out = red_sm[0];
#pragma unroll
  for (int w = 1; w < kSealThreads / 32; ++w) out = kMax ? fmaxf(out, red_sm[w]) : fminf(out, red_sm[w]);
  return out;
}

// grid: (num_seals, num_kv_heads, 2); block: kSealThreads threads.
// Block (s, h, z) seals head h of block seal_blocks[s] in the keys (z = 0) or values (z = 1): its
// block_size tokens are the int8 values of input rows seal_rows[s][offset] (new tokens, each
// row quantized to int8 and dequantized as quantize_kv_kernel would park it) or, where that is
// -1, the rows of residual slot seal_residual[s] (tokens parked while the block was open, int8
// blocks of residual_block_bytes). The int4 set of (block, head) is quantized as
// quant_codec.int4_encode defines: groups are channels (keys) or tokens (values).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kSealThreads) seal_int4_kernel(
    unsigned char* __restrict__ k_data,    // [num_blocks, k_block_bytes]
    unsigned char* __restrict__ v_data,    // [num_blocks, v_block_bytes]
    const T* __restrict__ k,               // [num_tokens, num_kv_heads, HEAD_DIM]
    const T* __restrict__ v,               // [num_tokens, num_kv_heads, HEAD_DIM]
    const unsigned char* __restrict__ k_residual,  // [num_residual_slots, residual_block_bytes]
    const unsigned char* __restrict__ v_residual,  // [num_residual_slots, residual_block_bytes]
    const int* __restrict__ seal_blocks,   // [num_seals]
    const int* __restrict__ seal_residual,  // [num_seals]
    const int* __restrict__ seal_rows,     // [num_seals, block_size]
    int num_kv_heads, int block_size, i64 k_block_bytes, i64 v_block_bytes, i64 k_meta_offset,
    i64 v_meta_offset, i64 k_side_offset, i64 v_side_offset, i64 residual_block_bytes,
    i64 residual_meta_offset) {
  static_assert(HEAD_DIM % 32 == 0, "a lane holds whole elements");
  __shared__ float x_sm[kMaxSealBlockSize][HEAD_DIM];
  __shared__ unsigned char q_sm[kMaxSealBlockSize][HEAD_DIM];
  __shared__ float lo_sm[HEAD_DIM];  // per group: min, max, quantized center, half step
  __shared__ float hi_sm[HEAD_DIM];
  __shared__ float chat_sm[HEAD_DIM];
  __shared__ float red_sm[kSealThreads / 32];
  __shared__ unsigned int side_sm[3];  // bfloat16 bits: grid start, grid step, half-step unit

  const int seal = blockIdx.x;
  const int head = blockIdx.y;
  const bool is_key = blockIdx.z == 0;
  const int tid = threadIdx.x;
  const T* src = is_key ? k : v;
  const unsigned char* residual = is_key ? k_residual : v_residual;
  unsigned char* block =
      (is_key ? k_data : v_data) + static_cast<i64>(load_scalar(seal_blocks + seal)) * (is_key ? k_block_bytes : v_block_bytes);
  const i64 meta_offset = is_key ? k_meta_offset : v_meta_offset;
  const i64 side_offset = is_key ? k_side_offset : v_side_offset;
  const int res_slot = load_scalar(seal_residual + seal);

  // The block's tokens of this head as their int8 residual rows hold them: a warp per token,
  // read from the residual slot, or from the write's row and round-tripped through int8 (its
  // scale from the row's maximum, as quantize_kv_kernel computes it).
  const int lane = tid & 31;
  for (int t = tid >> 5; t < block_size; t += kSealThreads / 32) {
    const int row = load_scalar(seal_rows + static_cast<i64>(seal) * block_size + t);
    if (row < 0) {
      const unsigned char* slot = residual + static_cast<i64>(res_slot) * residual_block_bytes;
      for (int d = lane; d < HEAD_DIM; d += 32) {
        x_sm[t][d] = QuantInt8::load<HEAD_DIM>(slot, t, head, d, num_kv_heads, residual_meta_offset, 0, is_key);
      }
      continue;  // the branch is uniform per warp: its shuffles below stay full
    }
    const T* p = src + (static_cast<i64>(row) * num_kv_heads + head) * HEAD_DIM;
    float amax = 0.f;
    float row_bad = 0.f;
    for (int d = lane; d < HEAD_DIM; d += 32) {
      const float x = Kv<T>::to_float(load_scalar(p + d));
      x_sm[t][d] = x;
      amax = fmaxf(amax, fabsf(x));
      row_bad = is_finite_float(x) ? row_bad : 1.f;
    }
    amax = warp_max(amax);
    row_bad = warp_max(row_bad);
    const unsigned int scale = ue5m3_scale_for<QuantInt8::kMaxCode, false>(amax, row_bad != 0.f);
    const float s = ue5m3_to_float(scale);  // NaN for a bad row: its values decode to NaN
    for (int d = lane; d < HEAD_DIM; d += 32) {
      const unsigned int code = scale == 0xffu ? 0u : QuantInt8::encode(__fdiv_rn(x_sm[t][d], s));
      x_sm[t][d] = QuantInt8::decode(code) * s;
    }
  }
  __syncthreads();

  // Groups: channel g over the tokens (keys), or token g over the channels (values).
  const int groups = is_key ? HEAD_DIM : block_size;
  const int n = is_key ? block_size : HEAD_DIM;
  auto x_at = [&](int g, int i) -> float { return is_key ? x_sm[i][g] : x_sm[g][i]; };
  float c_min = __int_as_float(0x7f800000);
  float c_max = -c_min;
  float bad = 0.f;
  for (int g = tid; g < groups; g += kSealThreads) {
    float mn = x_at(g, 0);
    float mx = mn;
    for (int i = 0; i < n; ++i) {
      const float x = x_at(g, i);
      bad = is_finite_float(x) ? bad : 1.f;
      mn = fminf(mn, x);
      mx = fmaxf(mx, x);
    }
    lo_sm[g] = mn;
    hi_sm[g] = mx;
    const float center = mn * 0.5f + mx * 0.5f;
    chat_sm[g] = center;
    c_min = fminf(c_min, center);
    c_max = fmaxf(c_max, center);
  }
  bad = block_extreme<true>(bad, red_sm);
  c_min = block_extreme<false>(c_min, red_sm);
  c_max = block_extreme<true>(c_max, red_sm);
  const unsigned int lo_bits = bf16_round_down(c_min);
  const float lo = bf16_bits_to_float(static_cast<unsigned short>(lo_bits));
  const unsigned int cstep_bits = bf16_round_up((c_max - lo) / 15.f);
  const float cstep = bf16_bits_to_float(static_cast<unsigned short>(cstep_bits));

  // Center codes, quantized centers and the half-range each group needs.
  float need_max = 0.f;
  for (int g = tid; g < groups; g += kSealThreads) {
    const float j = cstep > 0.f ? fminf(fmaxf(rintf((chat_sm[g] - lo) / cstep), 0.f), 15.f) : 0.f;
    const float chat = lo + j * cstep;
    const float need = fmaxf(hi_sm[g] - chat, chat - lo_sm[g]);
    chat_sm[g] = chat;
    lo_sm[g] = j;      // the center code, kept for the metadata byte
    hi_sm[g] = need;
    need_max = fmaxf(need_max, need);
  }
  need_max = block_extreme<true>(need_max, red_sm);
  unsigned int unit_bits = bf16_round_up(need_max / 15.f);
  for (int i = 0; i < 2; ++i) {  // need_max / 15 was rounded: make 15 * unit cover need_max
    if (15.f * bf16_bits_to_float(static_cast<unsigned short>(unit_bits)) < need_max) unit_bits += 1u;
  }
  const float unit = bf16_bits_to_float(static_cast<unsigned short>(unit_bits));
  if (tid == 0) {
    side_sm[0] = bad != 0.f ? 0x7fc0u : lo_bits;
    side_sm[1] = bad != 0.f ? 0x7fc0u : cstep_bits;
    side_sm[2] = bad != 0.f ? 0x7fc0u : unit_bits;
  }

  // Each group's ladder step and codes; its metadata byte.
  for (int g = tid; g < groups; g += kSealThreads) {
    const float need = hi_sm[g];
    unsigned int level = 0;
    for (unsigned int kk = 1; kk < 16; ++kk) {
      if (15.f * (int4_level(kk) * unit) >= need) level = kk;  // exact products: no rounding
    }
    const float half = int4_level(level) * unit;
    const float chat = chat_sm[g];
    for (int i = 0; i < n; ++i) {
      float code = 8.f;
      if (half > 0.f) code = fminf(fmaxf(rintf((x_at(g, i) - chat) / (half + half) + 7.5f), 0.f), 15.f);
      const unsigned char q = bad != 0.f ? 0 : static_cast<unsigned char>(code);
      if (is_key) {
        q_sm[i][g] = q;
      } else {
        q_sm[g][i] = q;
      }
    }
    const unsigned int meta = bad != 0.f ? 0u : ((static_cast<unsigned int>(lo_sm[g]) << 4) | level);
    const i64 where = is_key ? static_cast<i64>(head) * HEAD_DIM + g : static_cast<i64>(g) * num_kv_heads + head;
    store_scalar(block + meta_offset + where, static_cast<unsigned char>(meta));
  }
  __syncthreads();  // q_sm and side_sm complete

  for (int i = tid; i < block_size * (HEAD_DIM / 2); i += kSealThreads) {
    const int t = i / (HEAD_DIM / 2);
    const int pair = i % (HEAD_DIM / 2);
    const unsigned int byte = q_sm[t][2 * pair] | (q_sm[t][2 * pair + 1] << 4);
    store_scalar(block + (static_cast<i64>(t) * num_kv_heads + head) * (HEAD_DIM / 2) + pair, static_cast<unsigned char>(byte));
  }
  if (tid < 6) {
    const unsigned int bits = side_sm[tid / 2];
    store_scalar(block + side_offset + static_cast<i64>(head) * 6 + tid, static_cast<unsigned char>((tid & 1) ? bits >> 8 : bits & 0xffu));
  }
  // The padding after the side parameters is zero, as the reference writes it (a sealed block's
  // bytes are a function of its tokens alone). Head 0's thread block writes it.
  if (head == 0) {
    const i64 block_bytes = is_key ? k_block_bytes : v_block_bytes;
    for (i64 i = side_offset + static_cast<i64>(num_kv_heads) * 6 + tid; i < block_bytes; i += kSealThreads) {
      store_scalar(block + i, static_cast<unsigned char>(0));
    }
  }
}

}  // namespace pagedkv
