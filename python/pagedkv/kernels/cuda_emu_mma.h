// CPU emulation of the sm_80+ warp-level matrix instructions the tensor-core kernels use, on top of
// cuda_emu.h: mma.sync.aligned.m16n8k16 (f16/bf16 in, f32 accumulate), ldmatrix.sync.aligned.m8n8
// (.x1/.x2/.x4, with and without .trans) and cp.async.cg 16-byte copies with commit/wait groups.
// Included by mma_sm80.h when compiling for the CPU; never by code built for the GPU.
//
// Fragment layouts are the PTX ISA's ("Matrix Fragments for mma.m16n8k16 with floating point
// type", "Warp-level matrix load instruction: ldmatrix"). With groupID = lane >> 2 and
// tig = lane & 3 (thread id in group):
//   A (16x16, row major): 4 registers = 8 halves a_i, i = 0..7:
//       row = groupID + 8 * ((i >> 1) & 1), col = 2 * tig + (i & 1) + 8 * (i >> 2)
//   B (16x8, "col": K x N with K contiguous): 2 registers = 4 halves b_i, i = 0..3:
//       k = 2 * tig + (i & 1) + 8 * (i >> 1), n = groupID
//   C/D (16x8 f32): 4 floats c_i: row = groupID + 8 * (i >> 1), col = 2 * tig + (i & 1)
//   ldmatrix m8n8.b16: matrix j's 8 row addresses come from lanes 8j..8j+7; lane l receives in
//   register j the halves (row l / 4, cols 2 (l % 4) and 2 (l % 4) + 1); with .trans the halves
//   (rows 2 (l % 4) and 2 (l % 4) + 1, col l / 4) of the matrix as stored.
// In every 32-bit register the lower-indexed half sits in the low 16 bits.
//
// How the collectives run: mma and ldmatrix need every lane of the warp (the harness fails the
// launch otherwise, as the GPU's .sync.aligned would be undefined). Each lane publishes its
// registers (or row address) in a per-warp, double-buffered slot array and meets the others at the
// warp barrier; the same parity counter as cuda_emu.h's full-warp shuffles keeps the buffers
// race-free. ldmatrix meets a second time after reading, so no lane can overwrite shared memory
// that a slower lane of the same warp still has to load (on the GPU the warp loads as one).
//
// Numerics: the GPU's tensor-core accumulation order and internal precision are unspecified; the
// emulation sums the 16 exact products in double, adds C, and rounds once to fp32. Tests compare
// kernels to references with a tolerance, and the layout tests use small integers, exact either way.
//
// cp.async: the copy is deferred to the cp.async.wait_group that retires its group, and the
// destination is filled with 0xFF bytes (NaN) at issue, so a kernel that reads a tile before
// waiting for it, or issues a copy into a buffer other warps still read, sees NaN. Copies still
// pending when a block ends are dropped (they could only be read by a kernel bug).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace pkv_emu {

// One lane's contribution to a warp collective.
struct LaneRegs {
  unsigned int words[6];  // mma: A in 0..3, B in 4..5
  const void* address;    // ldmatrix: this lane's row address
};

constexpr int kMaxWarps = 32;  // 1024 threads
inline LaneRegs g_collective[kMaxWarps][2][32];

inline void fail_launch(const std::string& message) {
  tctx.launch->fail(message);
  throw Aborted();
}

// Publishes `mine`, waits for the whole warp, returns the 32 lanes' slots of this round.
inline const LaneRegs* warp_collective(const LaneRegs& mine, const char* what) {
  Warp& w = my_warp();
  if (w.exists_mask != 0xFFFFFFFFu || w.live_mask.load() != 0xFFFFFFFFu) {
    fail_launch(std::string(what) + " needs all 32 lanes of the warp (a partial or diverged warp)");
  }
  const unsigned int phase = tctx.full_phase++ & 1u;
  g_collective[tctx.warp][phase][tctx.lane] = mine;
  w.barrier.arrive_and_wait(tctx.launch->aborted, what);
  return g_collective[tctx.warp][phase];
}

// A meeting of the whole warp with nothing exchanged.
inline void warp_meet(const char* what) {
  tctx.full_phase++;
  my_warp().barrier.arrive_and_wait(tctx.launch->aborted, what);
}

// Whether [p, p + bytes) lies inside one __shared__ variable of this library.
inline bool in_shared(const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  for (const SharedRegion& r : shared_regions()) {
    const auto b = reinterpret_cast<std::uintptr_t>(r.address);
    if (a >= b && a + bytes <= b + r.bytes) return true;
  }
  return false;
}

inline float half16_to_float(unsigned short bits, bool bf16) {
  if (bf16) {
    const unsigned int u = static_cast<unsigned int>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  return pkv_emu_half_bits_to_float(bits);
}

inline unsigned short half_of(unsigned int word, int which) {
  return static_cast<unsigned short>(which ? word >> 16 : word & 0xFFFFu);
}

// d = a * b + c for one m16n8k16 tile; every argument is this lane's fragment.
inline void mma_m16n8k16(float* d, const unsigned int* a, const unsigned int* b, const float* c, bool bf16) {
  LaneRegs mine{};
  for (int i = 0; i < 4; ++i) mine.words[i] = a[i];
  mine.words[4] = b[0];
  mine.words[5] = b[1];
  const LaneRegs* all = warp_collective(mine, "mma.sync.m16n8k16");
  auto a_at = [&](int row, int col) {
    const int lane = (row & 7) * 4 + (col & 7) / 2;
    const int i = (col & 1) | ((row >> 3) << 1) | ((col >> 3) << 2);
    return half16_to_float(half_of(all[lane].words[i >> 1], i & 1), bf16);
  };
  auto b_at = [&](int k, int n) {
    const int lane = n * 4 + (k & 7) / 2;
    const int i = (k & 1) | ((k >> 3) << 1);
    return half16_to_float(half_of(all[lane].words[4 + (i >> 1)], i & 1), bf16);
  };
  const int group = tctx.lane >> 2;
  const int tig = tctx.lane & 3;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = group + 8 * (i >> 1);
    const int col = 2 * tig + (i & 1);
    double acc = 0.0;
    for (int k = 0; k < 16; ++k) acc += static_cast<double>(a_at(row, k)) * static_cast<double>(b_at(k, col));
    out[i] = static_cast<float>(acc + static_cast<double>(c[i]));
  }
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// ldmatrix.sync.aligned.m8n8.x{num}[.trans].shared.b16 with this lane's row address `row`
// (lanes past 8 * num may pass anything: their addresses are not used).
inline void ldmatrix(unsigned int* regs, int num, bool trans, const void* row) {
  LaneRegs mine{};
  mine.address = row;
  const LaneRegs* all = warp_collective(mine, "ldmatrix");
  for (int m = 0; m < num; ++m) {
    for (int r = 0; r < 8; ++r) {
      const void* p = all[8 * m + r].address;
      if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0 || !in_shared(p, 16)) {
        char message[160];
        std::snprintf(message, sizeof message,
                      "ldmatrix: row %d of matrix %d at %p is not a 16-byte aligned row of shared memory", r, m, p);
        fail_launch(message);
      }
    }
  }
  const int lane = tctx.lane;
  for (int m = 0; m < num; ++m) {
    unsigned short lo, hi;
    if (!trans) {
      const auto* src = static_cast<const unsigned short*>(all[8 * m + lane / 4].address);
      lo = src[2 * (lane % 4)];
      hi = src[2 * (lane % 4) + 1];
    } else {
      const auto* r0 = static_cast<const unsigned short*>(all[8 * m + 2 * (lane % 4)].address);
      const auto* r1 = static_cast<const unsigned short*>(all[8 * m + 2 * (lane % 4) + 1].address);
      lo = r0[lane / 4];
      hi = r1[lane / 4];
    }
    regs[m] = static_cast<unsigned int>(lo) | (static_cast<unsigned int>(hi) << 16);
  }
  warp_meet("ldmatrix (after the loads)");
}

// ---- cp.async ---------------------------------------------------------------------------------

struct AsyncCopy {
  void* dst;
  const void* src;
  int src_bytes;  // 16: copy; 0: zero-fill
};

struct AsyncState {
  std::uint64_t launch = 0;  // LaunchState::serial (a new launch may reuse the old state's address)
  std::uint64_t block = ~0ull;
  std::vector<AsyncCopy> open;                   // issued, not yet committed
  std::vector<std::vector<AsyncCopy>> groups;    // committed, oldest first
};

inline thread_local AsyncState t_async;

// This thread's queue, emptied when a new block (or launch) starts using it.
inline AsyncState& async_state() {
  const std::uint64_t block = blockIdx.x + 1ull * gridDim.x * (blockIdx.y + 1ull * gridDim.y * blockIdx.z);
  if (t_async.launch != tctx.launch->serial || t_async.block != block) {
    t_async.launch = tctx.launch->serial;
    t_async.block = block;
    t_async.open.clear();
    t_async.groups.clear();
  }
  return t_async;
}

inline void cp_async16(void* dst, const void* src, int src_bytes) {
  if (reinterpret_cast<std::uintptr_t>(dst) % 16 != 0 || !in_shared(dst, 16)) {
    fail_launch("cp.async: destination is not 16-byte aligned shared memory");
  }
  if (src_bytes != 0 && src_bytes != 16) fail_launch("cp.async: src-size must be 0 or 16");
  if (src_bytes) {
    if (reinterpret_cast<std::uintptr_t>(src) % 16 != 0) fail_launch("cp.async: source is not 16-byte aligned");
    check_access(src, 16, "cp.async source");
  }
  std::memset(dst, 0xFF, 16);  // NaN until the group is waited for
  async_state().open.push_back({dst, src, src_bytes});
}

inline void cp_async_commit() {
  AsyncState& s = async_state();
  s.groups.push_back(std::move(s.open));
  s.open.clear();
}

// Completes every committed group but the `pending` most recent ones.
inline void cp_async_wait(int pending) {
  AsyncState& s = async_state();
  while (static_cast<int>(s.groups.size()) > pending) {
    for (const AsyncCopy& c : s.groups.front()) {
      if (c.src_bytes) {
        std::memcpy(c.dst, c.src, 16);
      } else {
        std::memset(c.dst, 0, 16);
      }
    }
    s.groups.erase(s.groups.begin());
  }
}

}  // namespace pkv_emu
