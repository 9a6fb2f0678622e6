// CPU emulation of the CUDA execution model, so that the very same .cu kernel sources compile with
// g++ (C++20, -O2) and run on the CPU.
//
// Why this is a faithful (if slow) schedule: CUDA guarantees nothing about the order in which the
// blocks of a grid run, so running them one after another is a legal schedule. Inside a block the
// threads must run concurrently (they meet at __syncthreads and exchange data through shuffles),
// so each thread of a block is a real std::thread; the same threads are reused for every block.
//
//  * __syncthreads   -> a barrier over the block's threads. A thread that returns from the kernel
//                       drops out of it (as exited threads do on the GPU).
//  * __shfl_*_sync   -> full warps exchange through a per-warp buffer guarded by a per-warp
//                       barrier, double-buffered so one barrier per shuffle suffices; partial masks
//                       meet at a point keyed by the mask (write, meet, read, meet).
//  * __shared__      -> a function-local static. Blocks run one after another, so one instance per
//                       kernel is enough. Before each block every such static (found in the
//                       library's own ELF symbol table: writable objects local to a function of
//                       namespace pagedkv) is filled with 0xFF bytes, NaN for every float type, so
//                       a read of shared memory that was never written in this block shows up.
//  * half            -> _Float16; bfloat16 is bit arithmetic in the kernels' own header.
//  * Vector types reinterpreted over other element types carry __attribute__((may_alias)).
//
// A barrier that waits longer than PKV_EMU_TIMEOUT_S seconds (divergent __syncthreads, a shuffle
// some lane never reaches) aborts the launch with an error instead of hanging.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <math.h>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <dlfcn.h>
#include <elf.h>
#include <fstream>
#include <link.h>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#define PKV_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static
#define PKV_MAY_ALIAS __attribute__((may_alias))

#ifndef PKV_EMU_TIMEOUT_S
#define PKV_EMU_TIMEOUT_S 120
#endif

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = 32;


namespace pkv_emu {

// One launch at a time per library: shared memory statics and blockDim are per library.
static std::mutex g_launch_mutex;

struct SharedRegion {
  unsigned char* address;
  std::size_t bytes;
};

// The kernels' __shared__ statics: writable OBJECT symbols whose mangled name says "local to a
// function in namespace pagedkv" (_ZZN7pagedkv...). Read from this library's own .symtab.
inline std::vector<SharedRegion> find_shared_regions() {
  std::vector<SharedRegion> regions;
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&find_shared_regions), &info) || !info.dli_fname) return regions;
  const auto base = reinterpret_cast<std::uintptr_t>(info.dli_fbase);
  std::ifstream file(info.dli_fname, std::ios::binary);
  std::vector<char> image((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (image.size() < sizeof(Elf64_Ehdr)) return regions;
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(image.data());
  if (std::memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 || eh->e_ident[EI_CLASS] != ELFCLASS64) return regions;
  if (eh->e_shoff + 1ULL * eh->e_shnum * sizeof(Elf64_Shdr) > image.size()) return regions;
  const auto* sh = reinterpret_cast<const Elf64_Shdr*>(image.data() + eh->e_shoff);
  for (int i = 0; i < eh->e_shnum; ++i) {
    if (sh[i].sh_type != SHT_SYMTAB) continue;
    const Elf64_Shdr& strtab = sh[sh[i].sh_link];
    const auto* syms = reinterpret_cast<const Elf64_Sym*>(image.data() + sh[i].sh_offset);
    const std::size_t count = sh[i].sh_size / sizeof(Elf64_Sym);
    for (std::size_t s = 0; s < count; ++s) {
      const Elf64_Sym& sym = syms[s];
      if (ELF64_ST_TYPE(sym.st_info) != STT_OBJECT || sym.st_size == 0 || sym.st_shndx == SHN_UNDEF ||
          sym.st_shndx >= eh->e_shnum)
        continue;
      if (!(sh[sym.st_shndx].sh_flags & SHF_WRITE)) continue;
      const char* name = image.data() + strtab.sh_offset + sym.st_name;
      if (std::strncmp(name, "_ZZN7pagedkv", 12) != 0) continue;
      regions.push_back({reinterpret_cast<unsigned char*>(base + sym.st_value), sym.st_size});
    }
  }
  return regions;
}

inline const std::vector<SharedRegion>& shared_regions() {
  static const std::vector<SharedRegion> regions = find_shared_regions();
  return regions;
}

struct Aborted : std::exception {
  const char* what() const noexcept override { return "launch aborted"; }
};

struct LaunchState;

// A reusable barrier whose expected count can shrink while threads wait (arrive_and_drop), with a
// timeout so that a deadlocked kernel reports an error instead of hanging the test suite.
class Barrier {
 public:
  void reset(int expected) {
    std::lock_guard<std::mutex> lock(mutex_);
    expected_ = expected;
    arrived_ = 0;
  }
  void arrive_and_wait(const std::atomic<bool>& aborted, const char* what);
  void arrive_and_drop() {
    std::lock_guard<std::mutex> lock(mutex_);
    --expected_;
    complete_if_ready_locked();
  }
  void wake_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    cv_.notify_all();
  }

 private:
  void complete_if_ready_locked() {
    if (expected_ > 0 && arrived_ >= expected_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  int expected_ = 0;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
};

// Values travel through shuffles as raw bytes (CUDA shuffles 4- and 8-byte types).
struct Slot {
  unsigned char bytes[8];
};

struct Warp {
  Barrier barrier;              // all live lanes of the warp (full-mask operations)
  Slot slots[2][32];            // double buffer for full-mask shuffles
  std::atomic<unsigned int> live_mask{0};  // lanes that exist and have not exited the kernel
  unsigned int exists_mask = 0; // lanes that exist in this block shape
  // Partial-mask meeting points keyed by mask.
  std::mutex partial_mutex;
  std::condition_variable partial_cv;
  struct Meeting {
    int arrived = 0;
    std::uint64_t generation = 0;
  };
  std::map<unsigned int, Meeting> meetings;
  Slot partial_slots[32];
};

// A byte range the launch may touch (the arrays passed to it); 16-byte vector accesses outside
// every range abort the launch with an out-of-bounds error.
struct Range {
  std::uintptr_t begin;
  std::uintptr_t end;
};

inline std::atomic<std::uint64_t> g_launch_serial{0};

struct LaunchState {
  std::uint64_t serial = ++g_launch_serial;  // distinct per launch (per-thread state keys on it)
  std::vector<Range> bounds;  // empty: accesses are not checked
  std::atomic<bool> aborted{false};
  std::mutex error_mutex;
  std::string error;
  Barrier block_barrier;   // __syncthreads
  Barrier edge_barrier;    // between blocks (not visible to the kernel)
  std::vector<std::unique_ptr<Warp>> warps;
  int num_threads = 0;

  void fail(const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (error.empty()) error = message;
    }
    aborted.store(true);
    block_barrier.wake_all();
    edge_barrier.wake_all();
    for (auto& w : warps) {
      w->barrier.wake_all();
      std::lock_guard<std::mutex> lock(w->partial_mutex);
      w->partial_cv.notify_all();
    }
  }
};

struct ThreadContext {
  LaunchState* launch = nullptr;
  int linear = 0;
  int warp = 0;
  int lane = 0;
  unsigned int full_phase = 0;  // parity of this lane's full-mask shuffles
};

inline thread_local ThreadContext tctx;

inline void Barrier::arrive_and_wait(const std::atomic<bool>& aborted, const char* what) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (aborted.load()) throw Aborted();
  const std::uint64_t my_generation = generation_;
  ++arrived_;
  complete_if_ready_locked();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(PKV_EMU_TIMEOUT_S);
  while (generation_ == my_generation) {
    if (aborted.load()) throw Aborted();
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == my_generation) {
      lock.unlock();
      tctx.launch->fail(std::string("deadlock: ") + what + " waited " +
                        std::to_string(PKV_EMU_TIMEOUT_S) + " s (divergent barrier or shuffle?)");
      throw Aborted();
    }
  }
}

inline Warp& my_warp() { return *tctx.launch->warps[tctx.warp]; }

inline void check_member(unsigned int mask, const char* what) {
  if (!(mask >> tctx.lane & 1u)) {
    tctx.launch->fail(std::string(what) + ": calling lane is not in the mask");
    throw Aborted();
  }
}

// Exchanges `value` among the lanes of `mask`; returns the value lane `src` contributed, or bytes
// of 0xFF (NaN) when `src` is not a live member, so reading an inactive lane shows up.
inline Slot exchange(unsigned int mask, Slot value, int src, const char* what) {
  Warp& w = my_warp();
  check_member(mask, what);
  Slot poison;
  std::memset(poison.bytes, 0xFF, sizeof poison.bytes);
  LaunchState& L = *tctx.launch;
  if ((mask & w.exists_mask) == w.exists_mask) {
    // Full warp: every live lane takes part; one barrier per shuffle thanks to the double buffer
    // (a lane can only overwrite a buffer after all lanes passed the next barrier, i.e. read it).
    if ((mask & w.exists_mask & ~w.live_mask.load()) != 0) {
      L.fail(std::string(what) + ": mask names lanes that already exited the kernel");
      throw Aborted();
    }
    // Liveness is read before the barrier: once it opens, a faster lane may run on and exit the
    // kernel, and must not turn the value it already contributed into poison for slower lanes.
    const unsigned int live_members = mask & w.live_mask.load();
    const unsigned int phase = tctx.full_phase++ & 1u;
    w.slots[phase][tctx.lane] = value;
    w.barrier.arrive_and_wait(L.aborted, what);
    const bool live = src >= 0 && src < 32 && (live_members >> src & 1u);
    return live ? w.slots[phase][src] : poison;
  }
  // Partial mask: write, meet, read, meet.
  const unsigned int members = mask & w.live_mask;
  const int needed = __builtin_popcount(members);
  auto meet = [&](void) {
    std::unique_lock<std::mutex> lock(w.partial_mutex);
    Warp::Meeting& m = w.meetings[members];
    const std::uint64_t gen = m.generation;
    if (++m.arrived == needed) {
      m.arrived = 0;
      ++m.generation;
      w.partial_cv.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(PKV_EMU_TIMEOUT_S);
    while (w.meetings[members].generation == gen) {
      if (L.aborted.load()) throw Aborted();
      if (w.partial_cv.wait_until(lock, deadline) == std::cv_status::timeout &&
          w.meetings[members].generation == gen) {
        lock.unlock();
        L.fail(std::string("deadlock: ") + what + " (partial mask) timed out");
        throw Aborted();
      }
    }
  };
  w.partial_slots[tctx.lane] = value;
  meet();
  const bool live = src >= 0 && src < 32 && (members >> src & 1u);
  Slot out = live ? w.partial_slots[src] : poison;
  meet();
  return out;
}

template <class T>
inline Slot to_slot(T v) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  Slot s;
  std::memset(s.bytes, 0, sizeof s.bytes);
  std::memcpy(s.bytes, &v, sizeof(T));
  return s;
}

template <class T>
inline T from_slot(const Slot& s) {
  T v;
  std::memcpy(&v, s.bytes, sizeof(T));
  return v;
}

// Runs one grid: the block's threads are real threads reused across the blocks of the grid.
template <class... Params>
inline int run_grid(dim3 grid, dim3 block, void (*kernel)(Params...), std::tuple<Params...> args,
                    std::vector<Range> bounds, char* error_out, int error_capacity) {
  std::lock_guard<std::mutex> guard(g_launch_mutex);
  const std::vector<SharedRegion>& shared = shared_regions();
  const long long threads = 1LL * block.x * block.y * block.z;
  const long long blocks = 1LL * grid.x * grid.y * grid.z;
  auto report = [&](const std::string& message) {
    if (error_out && error_capacity > 0) {
      std::snprintf(error_out, static_cast<size_t>(error_capacity), "%s", message.c_str());
    }
  };
  if (threads < 1 || threads > 1024) {
    report("block must have 1..1024 threads");
    return 1;
  }
  if (blocks < 1 || grid.y > 65535 || grid.z > 65535) {
    report("grid must have >= 1 block, y and z <= 65535");
    return 1;
  }
  LaunchState L;
  L.bounds = std::move(bounds);
  L.num_threads = static_cast<int>(threads);
  const int num_warps = static_cast<int>((threads + 31) / 32);
  for (int w = 0; w < num_warps; ++w) {
    L.warps.push_back(std::make_unique<Warp>());
    const int lanes = static_cast<int>(std::min<long long>(32, threads - 32LL * w));
    L.warps[w]->exists_mask = lanes == 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1u);
  }
  blockDim = block;
  gridDim = grid;
  L.edge_barrier.reset(L.num_threads);
  auto body = [&](int linear) {
    tctx = ThreadContext{};
    tctx.launch = &L;
    tctx.linear = linear;
    tctx.warp = linear / 32;
    tctx.lane = linear % 32;
    threadIdx = dim3(linear % block.x, (linear / block.x) % block.y, linear / (block.x * block.y));
    try {
      for (long long b = 0; b < blocks; ++b) {
        if (linear == 0) {
          // Between blocks every thread waits at the edge barrier, so resetting is race-free.
          L.block_barrier.reset(L.num_threads);
          for (auto& w : L.warps) {
            w->barrier.reset(__builtin_popcount(w->exists_mask));
            w->live_mask = w->exists_mask;
          }
          for (const SharedRegion& r : shared) std::memset(r.address, 0xFF, r.bytes);
        }
        L.edge_barrier.arrive_and_wait(L.aborted, "block start");
        tctx.full_phase = 0;
        blockIdx = dim3(static_cast<unsigned>(b % grid.x), static_cast<unsigned>((b / grid.x) % grid.y),
                        static_cast<unsigned>(b / (1LL * grid.x * grid.y)));
        std::apply(kernel, args);
        // Exited: stop counting towards __syncthreads and full-warp shuffles.
        {
          Warp& w = my_warp();
          w.live_mask.fetch_and(~(1u << tctx.lane));
          w.barrier.arrive_and_drop();
        }
        L.block_barrier.arrive_and_drop();
        L.edge_barrier.arrive_and_wait(L.aborted, "block end");
      }
    } catch (const Aborted&) {
    } catch (const std::exception& e) {
      L.fail(e.what());
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) pool.emplace_back(body, t);
  for (auto& t : pool) t.join();
  if (L.aborted.load()) {
    report(L.error.empty() ? std::string("launch aborted") : L.error);
    return 2;
  }
  return 0;
}

template <class T>
inline T from_bytes(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// cuLaunchKernel-style entry: params[i] points at the i-th kernel argument's value.
template <class... Params, std::size_t... I>
inline std::tuple<Params...> unpack(void** params, std::index_sequence<I...>) {
  return std::tuple<Params...>(from_bytes<Params>(params[I])...);
}

}  // namespace pkv_emu

namespace pkv_emu {

template <class... Params>
inline int launch_packed(void (*kernel)(Params...), unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, void** params, const unsigned long long* bound_begins,
                         const unsigned long long* bound_sizes, int num_bounds, char* error_out,
                         int error_capacity) {
  auto args = unpack<Params...>(params, std::index_sequence_for<Params...>{});
  std::vector<Range> bounds;
  for (int i = 0; i < num_bounds; ++i) {
    bounds.push_back({static_cast<std::uintptr_t>(bound_begins[i]),
                      static_cast<std::uintptr_t>(bound_begins[i] + bound_sizes[i])});
  }
  return run_grid(dim3(gx, gy, gz), dim3(bx, by, bz), kernel, args, std::move(bounds), error_out,
                  error_capacity);
}

// Called by the kernels' vector loads and stores (kv_types.h) under emulation.
inline void check_access(const void* ptr, std::size_t bytes, const char* what) {
  LaunchState* L = tctx.launch;
  if (!L || L->bounds.empty()) return;
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  for (const Range& r : L->bounds) {
    if (a >= r.begin && a + bytes <= r.end) return;
  }
  char message[160];
  std::snprintf(message, sizeof message, "out-of-bounds %s of %zu bytes at %p (block %u,%u,%u thread %u)", what,
                bytes, ptr, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
  L->fail(message);
  throw Aborted();
}
}  // namespace pkv_emu

// ---- CUDA device API used by the kernels -------------------------------------------------------

inline void __syncthreads() {
  pkv_emu::LaunchState& L = *pkv_emu::tctx.launch;
  L.block_barrier.arrive_and_wait(L.aborted, "__syncthreads");
}

inline void __syncwarp(unsigned int mask = 0xFFFFFFFFu) {
  pkv_emu::exchange(mask, pkv_emu::Slot{}, pkv_emu::tctx.lane, "__syncwarp");
}

template <class T>
inline T __shfl_sync(unsigned int mask, T var, int src_lane, int width = 32) {
  const int lane = pkv_emu::tctx.lane;
  const int base = lane - lane % width;
  const int src = base + ((src_lane % width) + width) % width;
  return pkv_emu::from_slot<T>(pkv_emu::exchange(mask, pkv_emu::to_slot(var), src, "__shfl_sync"));
}

template <class T>
inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = 32) {
  const int lane = pkv_emu::tctx.lane;
  int src = lane ^ lane_mask;
  // A lane may read an earlier segment but not a later one: then it gets its own value.
  if (src / width > lane / width) src = lane;
  return pkv_emu::from_slot<T>(pkv_emu::exchange(mask, pkv_emu::to_slot(var), src, "__shfl_xor_sync"));
}

template <class T>
inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
  const int lane = pkv_emu::tctx.lane;
  int src = lane + static_cast<int>(delta);
  if (src / width != lane / width) src = lane;
  return pkv_emu::from_slot<T>(pkv_emu::exchange(mask, pkv_emu::to_slot(var), src, "__shfl_down_sync"));
}

template <class T>
inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
  const int lane = pkv_emu::tctx.lane;
  int src = lane - static_cast<int>(delta);
  if (src < 0 || src / width != lane / width) src = lane;
  return pkv_emu::from_slot<T>(pkv_emu::exchange(mask, pkv_emu::to_slot(var), src, "__shfl_up_sync"));
}

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}
inline float __uint_as_float(unsigned int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}
// expf, exp2f, fmaxf, fminf, fabsf: the C library's (<math.h>, via <cmath>).
inline float __fdividef(float a, float b) { return a / b; }
inline float __fdiv_rn(float a, float b) { return a / b; }  // IEEE float32 division
inline float __frcp_rn(float a) { return 1.0f / a; }

// Half precision: _Float16 conversions are IEEE round-to-nearest-even, as cvt.rn on the GPU.
inline float pkv_emu_half_bits_to_float(unsigned short bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}
inline unsigned short pkv_emu_float_to_half_bits(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  unsigned short bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

// CUDA's integer min/max overloads.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
