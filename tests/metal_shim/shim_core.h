// CPU emulator of a GPU launch grid, shared by the Metal and CUDA language shims.
//
// Every thread of a threadgroup (CUDA block) is a cooperative fiber (ucontext). A fiber runs
// until it reaches a synchronisation point (threadgroup barrier or a SIMD collective), then
// yields. The scheduler releases a barrier once every thread of the group has arrived, and a
// SIMD collective once all 32 lanes of the simdgroup (warp) arrived at the same collective.
// Anything else is reported as an error and the process exits non-zero:
//   - a barrier that some threads never reach (they returned, or wait elsewhere),
//   - a SIMD collective reached by only some lanes, or by lanes at different call sites,
//   - a threadgroup whose size is not a multiple of 32 (the simd width used here).
// Within each scheduling round the runnable fibers run in a seeded random order, so code that
// reads threadgroup memory without a barrier sees other threads' writes in varying order (or
// the poison that fills threadgroup memory at the start of each group).
//
// Buffers end exactly at a PROT_NONE guard page: reading or writing past the end of any input
// or output faults, and the SIGSEGV handler names the buffer.

#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

namespace shim {

constexpr int kSimdWidth = 32;
constexpr size_t kStackBytes = 256 * 1024;

struct dim3u {
  unsigned x = 1, y = 1, z = 1;
};

enum State { RUNNABLE, WAIT_TG, WAIT_SIMD, DONE };

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;
  State state = RUNNABLE;
  dim3u tid;           // position in the threadgroup
  unsigned linear = 0; // index in the threadgroup
  uint64_t simd_seq = 0;
  const char* simd_op = nullptr;
  uint64_t tg_seq = 0;
};

struct SimdSlots {
  alignas(16) unsigned char data[2][kSimdWidth][16];
};

struct Buffer {
  unsigned char* data = nullptr;
  size_t bytes = 0;
  std::string name;
};

struct Launch {
  dim3u grid_threads;    // threads per dimension as the caller asked (Metal: exact; CUDA: rounded up)
  dim3u tg;              // threads per threadgroup
  dim3u ntg;             // threadgroups per grid
  dim3u tg_pos;          // current threadgroup
  std::vector<Fiber> fibers;
  std::vector<SimdSlots> slots;
  std::vector<Buffer> buffers;
  void (*kernel)() = nullptr;
  ucontext_t sched;
  int cur = -1;
  uint64_t rng = 1;
  // threadgroup memory: one arena per group, poisoned at the start of each group
  std::vector<unsigned char> arena;
  std::vector<std::pair<int, size_t>> tg_offsets;
  size_t arena_used = 0;
};

inline Launch* L = nullptr;

[[noreturn]] inline void fail(const char* fmt, const char* a = "", long b = 0, long c = 0) {
  std::fprintf(stderr, "EMULATOR ERROR: ");
  std::fprintf(stderr, fmt, a, b, c);
  std::fprintf(stderr, " (threadgroup %u,%u,%u)\n", L ? L->tg_pos.x : 0, L ? L->tg_pos.y : 0,
               L ? L->tg_pos.z : 0);
  std::fflush(stderr);
  _exit(3);
}

inline Fiber& me() { return L->fibers[L->cur]; }
inline unsigned tg_size() { return L->tg.x * L->tg.y * L->tg.z; }
inline unsigned lane_id() { return me().linear % kSimdWidth; }
inline unsigned simd_id() { return me().linear / kSimdWidth; }

inline void yield(State s) {
  Fiber& f = me();
  f.state = s;
  swapcontext(&f.ctx, &L->sched);
}

inline uint64_t next_random() {  // xorshift64*
  L->rng ^= L->rng >> 12;
  L->rng ^= L->rng << 25;
  L->rng ^= L->rng >> 27;
  return L->rng * 0x2545F4914F6CDD1DULL;
}

inline void threadgroup_barrier_impl() {
  me().tg_seq++;
  yield(WAIT_TG);
}

// Deposit this lane's value, wait for the whole simdgroup, return the 32 lanes' values.
template <class T>
inline std::array<T, kSimdWidth> simd_exchange(const T& v, const char* op) {
  static_assert(sizeof(T) <= 16, "simd value too large for the emulator");
  Fiber& f = me();
  unsigned par = unsigned(f.simd_seq & 1);
  SimdSlots& s = L->slots[simd_id()];
  std::memcpy(s.data[par][lane_id()], &v, sizeof(T));
  f.simd_op = op;
  f.simd_seq++;
  yield(WAIT_SIMD);
  std::array<T, kSimdWidth> vals;
  for (int i = 0; i < kSimdWidth; ++i) std::memcpy(&vals[i], s.data[par][i], sizeof(T));
  return vals;
}

template <class T>
inline T* tg_alloc_impl(int id, size_t bytes, size_t align) {
  for (auto& [key, off] : L->tg_offsets)
    if (key == id) return reinterpret_cast<T*>(L->arena.data() + off);
  size_t off = (L->arena_used + align - 1) / align * align;
  if (off + bytes > L->arena.size()) fail("threadgroup memory exceeds the emulator arena (%s)");
  std::memset(L->arena.data() + off, 0xFF, bytes);  // poison: NaN for floats, -1 for ints
  L->arena_used = off + bytes;
  L->tg_offsets.emplace_back(id, off);
  return reinterpret_cast<T*>(L->arena.data() + off);
}

template <class A>
inline A* tg_alloc(int id) {
  return tg_alloc_impl<A>(id, sizeof(A), alignof(A) < 16 ? 16 : alignof(A));
}

inline void fiber_entry() {
  L->kernel();
  me().state = DONE;
  // returning resumes uc_link (the scheduler)
}

inline void run_group() {
  const unsigned n = tg_size();
  L->arena_used = 0;
  L->tg_offsets.clear();
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = L->fibers[i];
    f.linear = i;
    f.tid.x = i % L->tg.x;
    f.tid.y = (i / L->tg.x) % L->tg.y;
    f.tid.z = i / (L->tg.x * L->tg.y);
    f.state = RUNNABLE;
    f.simd_seq = 0;
    f.tg_seq = 0;
    f.simd_op = nullptr;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &L->sched;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  std::vector<unsigned> order(n);
  for (;;) {
    order.clear();
    for (unsigned i = 0; i < n; ++i)
      if (L->fibers[i].state == RUNNABLE) order.push_back(i);
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);
    for (unsigned i : order) {
      L->cur = int(i);
      swapcontext(&L->sched, &L->fibers[i].ctx);
    }
    L->cur = -1;
    unsigned done = 0, wait_tg = 0;
    for (unsigned i = 0; i < n; ++i) {
      done += L->fibers[i].state == DONE;
      wait_tg += L->fibers[i].state == WAIT_TG;
    }
    if (done == n) return;
    bool progress = false;
    // SIMD collectives: all 32 lanes at the same collective
    for (unsigned s = 0; s < n / kSimdWidth; ++s) {
      Fiber* lanes = &L->fibers[s * kSimdWidth];
      int waiting = 0;
      for (int l = 0; l < kSimdWidth; ++l) waiting += lanes[l].state == WAIT_SIMD;
      if (waiting == 0) continue;
      if (waiting != kSimdWidth) {
        for (int l = 0; l < kSimdWidth; ++l)
          if (lanes[l].state != WAIT_SIMD)
            fail("SIMD collective %s in simdgroup %ld: lane %ld is not there (exited, or at a barrier)",
                 lanes[0].simd_op ? lanes[0].simd_op : "?", long(s), long(l));
      }
      for (int l = 1; l < kSimdWidth; ++l)
        if (lanes[l].simd_seq != lanes[0].simd_seq || lanes[l].simd_op != lanes[0].simd_op)
          fail("divergent SIMD collectives (%s) in simdgroup %ld, lane %ld", lanes[l].simd_op, long(s),
               long(l));
      for (int l = 0; l < kSimdWidth; ++l) lanes[l].state = RUNNABLE;
      progress = true;
    }
    if (!progress && wait_tg > 0) {
      if (wait_tg + done != n || done > 0)
        fail("threadgroup barrier not reached by every thread (%s%ld waiting, %ld exited)", "",
             long(wait_tg), long(done));
      for (unsigned i = 0; i < n; ++i)
        if (L->fibers[i].tg_seq != L->fibers[0].tg_seq)
          fail("threads wait at different barriers (%s)");
      for (unsigned i = 0; i < n; ++i) L->fibers[i].state = RUNNABLE;
      progress = true;
    }
    if (!progress) fail("deadlock (%s)");
  }
}

// ---- guarded buffers ----

inline size_t page() { return size_t(sysconf(_SC_PAGESIZE)); }

inline unsigned char* guarded_alloc(size_t bytes) {
  size_t pg = page();
  size_t span = (bytes + pg - 1) / pg * pg;
  unsigned char* base = static_cast<unsigned char*>(
      mmap(nullptr, span + pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) fail("mmap failed (%s)");
  mprotect(base + span, pg, PROT_NONE);
  // end the buffer exactly at the guard page; the start is then aligned to the largest power
  // of two (up to 16) dividing the size, enough for the element type
  return base + (span - bytes);
}

inline void on_segv(int, siginfo_t* info, void*) {
  const unsigned char* a = static_cast<const unsigned char*>(info->si_addr);
  char msg[512];
  int len = std::snprintf(msg, sizeof msg, "EMULATOR ERROR: memory fault at %p", (const void*)a);
  if (L) {
    for (auto& b : L->buffers) {
      if (a >= b.data && a < b.data + b.bytes + page()) {
        len += std::snprintf(msg + len, sizeof msg - len, ": past the end of buffer '%s' (%zu bytes)",
                             b.name.c_str(), b.bytes);
        break;
      }
    }
    len += std::snprintf(msg + len, sizeof msg - len, " (threadgroup %u,%u,%u)\n", L->tg_pos.x,
                         L->tg_pos.y, L->tg_pos.z);
  }
  ssize_t ignored = write(2, msg, len);
  (void)ignored;
  _exit(3);
}

inline void install_segv_handler() {
  static std::vector<char> alt(1 << 16);
  stack_t ss{};
  ss.ss_sp = alt.data();
  ss.ss_size = alt.size();
  sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
}

// Run every threadgroup of the grid.
inline void run_grid(void (*kernel)(), unsigned seed) {
  L->kernel = kernel;
  L->rng = 0x9E3779B97F4A7C15ULL ^ seed;
  const unsigned n = tg_size();
  if (n % kSimdWidth != 0) fail("threadgroup size %s%ld is not a multiple of 32", "", long(n));
  if (L->fibers.size() < n) {
    L->fibers.resize(n);
    for (auto& f : L->fibers)
      if (!f.stack) f.stack = static_cast<char*>(std::malloc(kStackBytes));
  }
  L->slots.resize(n / kSimdWidth);
  if (L->arena.empty()) L->arena.resize(1 << 20);
  for (unsigned z = 0; z < L->ntg.z; ++z)
    for (unsigned y = 0; y < L->ntg.y; ++y)
      for (unsigned x = 0; x < L->ntg.x; ++x) {
        L->tg_pos = {x, y, z};
        run_group();
      }
}

// ---- process entry: read inputs, launch twice with different poison and schedules ----
//
// argv: variant grid.x grid.y grid.z tg.x tg.y tg.z in.bin out.bin n_in n_out sizes... names...
// Outputs are filled with 0xFF bytes before the first launch and 0x7F bytes before the
// second; any byte that differs between the two runs was not written (or depends on the
// schedule), and is reported.

using VariantFn = void (*)();

inline int main(int argc, char** argv, VariantFn* variants, int nvariants, bool cuda_grid) {
  if (argc < 12) {
    std::fprintf(stderr, "usage: variant gx gy gz tx ty tz in.bin out.bin n_in n_out sizes...\n");
    return 2;
  }
  int variant = std::atoi(argv[1]);
  if (variant < 0 || variant >= nvariants) return 2;
  static Launch launch;
  L = &launch;
  dim3u grid{unsigned(std::atoi(argv[2])), unsigned(std::atoi(argv[3])), unsigned(std::atoi(argv[4]))};
  launch.tg = {unsigned(std::atoi(argv[5])), unsigned(std::atoi(argv[6])), unsigned(std::atoi(argv[7]))};
  auto ceil_div = [](unsigned a, unsigned b) { return (a + b - 1) / b; };
  if (!cuda_grid) {
    // Metal dispatchThreads would make partial threadgroups at the edges: outside the subset.
    if (grid.x % launch.tg.x || grid.y % launch.tg.y || grid.z % launch.tg.z)
      fail("grid is not a multiple of the threadgroup size (%s): outside the emulated subset");
  }
  launch.ntg = {ceil_div(grid.x, launch.tg.x), ceil_div(grid.y, launch.tg.y), ceil_div(grid.z, launch.tg.z)};
  launch.grid_threads = {launch.ntg.x * launch.tg.x, launch.ntg.y * launch.tg.y, launch.ntg.z * launch.tg.z};
  const char* in_path = argv[8];
  const char* out_path = argv[9];
  int n_in = std::atoi(argv[10]), n_out = std::atoi(argv[11]);
  if (argc < 12 + 2 * (n_in + n_out)) return 2;
  std::vector<size_t> sizes;
  for (int i = 0; i < n_in + n_out; ++i) sizes.push_back(size_t(std::atoll(argv[12 + i])));
  install_segv_handler();
  FILE* fin = std::fopen(in_path, "rb");
  if (!fin) return 2;
  for (int i = 0; i < n_in + n_out; ++i) {
    Buffer b;
    b.bytes = sizes[i];
    b.name = argv[12 + n_in + n_out + i];
    b.data = guarded_alloc(b.bytes);
    if (i < n_in && b.bytes && std::fread(b.data, 1, b.bytes, fin) != b.bytes) return 2;
    launch.buffers.push_back(b);
  }
  std::fclose(fin);
  std::vector<std::vector<unsigned char>> first(n_out);
  const unsigned char poison[2] = {0xFF, 0x7F};
  for (int run = 0; run < 2; ++run) {
    for (int o = 0; o < n_out; ++o) std::memset(launch.buffers[n_in + o].data, poison[run], sizes[n_in + o]);
    run_grid(variants[variant], 1234u + 7919u * unsigned(run));
    for (int o = 0; o < n_out; ++o) {
      const Buffer& b = launch.buffers[n_in + o];
      if (run == 0) {
        first[o].assign(b.data, b.data + b.bytes);
        continue;
      }
      size_t bad = 0, first_bad = 0;
      for (size_t j = 0; j < b.bytes; ++j)
        if (b.data[j] != first[o][j]) {
          if (!bad) first_bad = j;
          ++bad;
        }
      if (bad) {
        std::fprintf(stderr,
                     "EMULATOR ERROR: output '%s': %zu bytes differ between two runs with different "
                     "poison and schedule (first at byte %zu): elements left unwritten or racy\n",
                     b.name.c_str(), bad, first_bad);
        return 4;
      }
    }
  }
  FILE* fout = std::fopen(out_path, "wb");
  for (int o = 0; o < n_out; ++o) std::fwrite(launch.buffers[n_in + o].data, 1, sizes[n_in + o], fout);
  std::fclose(fout);
  return 0;
}

}  // namespace shim
