// Standalone ThreadSanitizer driver: runs the real kernels through the emulation harness with
// small shapes (decode with splits, merge, write_kv, copy_blocks) so TSan can see every access the
// block's threads make. A missing __syncthreads or an unsafe shuffle shows up as a data race.
// Built and run by test_tsan.py; exits non-zero on a wrong result.
#include <cstdio>
#include <vector>

#include "cuda_emu.h"
#include "paged_attention.cu"
#include "cache_ops.cu"

using pagedkv::f16;

static f16 h(float x) { return f16{pkv_emu_float_to_half_bits(x)}; }
static float f(f16 x) { return pkv_emu_half_bits_to_float(x.bits); }

template <class... P>
static int launch(void (*kernel)(P...), dim3 grid, dim3 block, P... args) {
  char error[256] = {0};
  const int rc = pkv_emu::run_grid(grid, block, kernel, std::tuple<P...>(args...), {}, error, sizeof error);
  if (rc != 0) std::fprintf(stderr, "launch failed: %s\n", error);
  return rc;
}

int main() {
  constexpr int kHeads = 1, kGroup = 4, kDim = 64, kBlock = 16, kBlocks = 4, kTokens = 40, kSplits = 2;
  const int row = kHeads * kDim;
  std::vector<f16> k_cache(kBlocks * kBlock * row, h(0.f)), v_cache(k_cache.size(), h(0.f));
  std::vector<f16> k(kTokens * row), v(kTokens * row), q(kHeads * kGroup * kDim);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = h(0.01f * static_cast<float>(i % 97) - 0.4f);
    v[i] = h(0.02f * static_cast<float>(i % 89) - 0.8f);
  }
  for (size_t i = 0; i < q.size(); ++i) q[i] = h(0.05f * static_cast<float>(i % 13) - 0.3f);
  const int table[3] = {2, 0, 3};
  std::vector<long long> slots(kTokens);
  for (int t = 0; t < kTokens; ++t) slots[t] = static_cast<long long>(table[t / kBlock]) * kBlock + t % kBlock;

  if (launch(&pagedkv::write_kv_kernel<f16, kDim>, dim3(kTokens), dim3(pagedkv::kCopyThreads), k_cache.data(),
             v_cache.data(), static_cast<const f16*>(k.data()), static_cast<const f16*>(v.data()),
             static_cast<const long long*>(slots.data()), kHeads))
    return 1;
  // Copy block 3 (the last, partial block) onto block 1, then read through a table naming block 1.
  const long long addresses[2] = {reinterpret_cast<long long>(k_cache.data()),
                                  reinterpret_cast<long long>(v_cache.data())};
  const int ops[2] = {3, 1};
  if (launch(&pagedkv::copy_blocks_kernel<4>, dim3(1, 1, 2), dim3(pagedkv::kCopyThreads),
             static_cast<const long long*>(addresses), static_cast<const int*>(ops),
             static_cast<long long>(kBlock * row * sizeof(f16) / 16)))
    return 1;
  const int tables[3] = {2, 0, 1};
  const int lens[1] = {kTokens};
  std::vector<f16> out(q.size(), h(0.f));
  std::vector<float> split_out(kGroup * kSplits * kDim), split_max(kGroup * kSplits), split_sum(kGroup * kSplits);
  const float scale_log2 = 1.4426950408889634f / 8.f;
  if (launch(&pagedkv::paged_decode_kernel<f16, kDim, kBlock, kGroup>, dim3(kHeads, 1, kSplits),
             dim3(pagedkv::kDecodeThreads), out.data(), split_out.data(), split_max.data(), split_sum.data(),
             static_cast<const f16*>(q.data()), static_cast<const f16*>(k_cache.data()),
             static_cast<const f16*>(v_cache.data()), static_cast<const int*>(tables),
             static_cast<const int*>(lens), kHeads, kGroup, 3, 32, scale_log2, 0))
    return 1;
  if (launch(&pagedkv::merge_splits_kernel<f16, kDim>, dim3(kHeads * kGroup, 1), dim3(pagedkv::kMergeThreads),
             out.data(), static_cast<const float*>(split_out.data()), static_cast<const float*>(split_max.data()),
             static_cast<const float*>(split_sum.data()), kSplits))
    return 1;
  // Reference for head 0 in double precision.
  for (int g = 0; g < kGroup; ++g) {
    std::vector<double> s(kTokens);
    double m = -1e300, denom = 0;
    for (int t = 0; t < kTokens; ++t) {
      double dot = 0;
      for (int d = 0; d < kDim; ++d) dot += f(q[g * kDim + d]) * f(k[t * row + d]);
      s[t] = dot / 8.0;
      m = s[t] > m ? s[t] : m;
    }
    for (int t = 0; t < kTokens; ++t) denom += std::exp(s[t] - m);
    for (int d = 0; d < kDim; ++d) {
      double acc = 0;
      for (int t = 0; t < kTokens; ++t) acc += std::exp(s[t] - m) / denom * f(v[t * row + d]);
      const double got = f(out[g * kDim + d]);
      if (!(std::fabs(got - acc) < 3e-3)) {
        std::fprintf(stderr, "mismatch head %d dim %d: %f vs %f\n", g, d, got, acc);
        return 2;
      }
    }
  }
  std::printf("tsan driver ok\n");
  return 0;
}
