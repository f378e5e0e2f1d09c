// The subset of the Metal Shading Language that mlxspec kernels use, as C++ on the CPU.
// See shim_core.h for the execution model and mlxspec/kernels/README.md for the subset.
//
// Address spaces (device, constant, thread) are dropped; `threadgroup T name[N]...;`
// declarations in a kernel body are rewritten by the emulator into per-threadgroup storage
// (tests/metal_shim/emulator.py), other uses of `threadgroup` (pointer qualifiers) are dropped.

#pragma once

#include "shim_core.h"

#define device
#define constant
#define thread
#define threadgroup
#define METAL_FUNC inline

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
typedef _Float16 float16_t;

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {  // round to nearest even
    uint32_t u = std::bit_cast<uint32_t>(f);
    bits = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const { return std::bit_cast<float>(uint32_t(bits) << 16); }
};
typedef bfloat16_t bfloat;

struct uint3 {
  unsigned x, y, z;
};

namespace metal {

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }

inline void threadgroup_barrier(mem_flags) { shim::threadgroup_barrier_impl(); }
inline void simdgroup_barrier(mem_flags) { (void)shim::simd_exchange<int>(0, "simdgroup_barrier"); }

template <class To, class From>
inline To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  return std::bit_cast<To>(v);
}

inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float log2(float x) { return std::log2(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float floor(float x) { return std::floor(x); }
inline float ceil(float x) { return std::ceil(x); }
inline float fabs(float x) { return std::fabs(x); }
inline float abs(float x) { return std::fabs(x); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
template <class T>
inline T max(T a, T b) { return a < b ? b : a; }
template <class T>
inline T min(T a, T b) { return b < a ? b : a; }
template <class T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }
using std::numeric_limits;

namespace fast {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
}  // namespace fast
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
}  // namespace precise

// SIMD-group functions (32 lanes). Sums run in lane order; hardware uses another order,
// so compare floating-point results with a tolerance.
template <class T>
inline T simd_sum(T v) {
  auto a = shim::simd_exchange(v, "simd_sum");
  T s = a[0];
  for (int i = 1; i < shim::kSimdWidth; ++i) s = s + a[i];
  return s;
}
template <class T>
inline T simd_max(T v) {
  auto a = shim::simd_exchange(v, "simd_max");
  T s = a[0];
  for (int i = 1; i < shim::kSimdWidth; ++i) s = a[i] > s ? a[i] : s;
  return s;
}
template <class T>
inline T simd_min(T v) {
  auto a = shim::simd_exchange(v, "simd_min");
  T s = a[0];
  for (int i = 1; i < shim::kSimdWidth; ++i) s = a[i] < s ? a[i] : s;
  return s;
}
template <class T>
inline T simd_shuffle_xor(T v, ushort mask) {
  return shim::simd_exchange(v, "simd_shuffle_xor")[(shim::lane_id() ^ mask) % shim::kSimdWidth];
}
template <class T>
inline T simd_shuffle(T v, ushort lane) {
  return shim::simd_exchange(v, "simd_shuffle")[lane % shim::kSimdWidth];
}
template <class T>
inline T simd_broadcast(T v, ushort lane) {
  return shim::simd_exchange(v, "simd_broadcast")[lane % shim::kSimdWidth];
}
template <class T>
inline T simd_broadcast_first(T v) {
  return shim::simd_exchange(v, "simd_broadcast_first")[0];
}
template <class T>
inline T simd_shuffle_down(T v, ushort delta) {
  auto a = shim::simd_exchange(v, "simd_shuffle_down");
  unsigned src = shim::lane_id() + delta;
  return src < unsigned(shim::kSimdWidth) ? a[src] : v;
}
template <class T>
inline T simd_prefix_exclusive_sum(T v) {
  auto a = shim::simd_exchange(v, "simd_prefix_exclusive_sum");
  T s = T(0);
  for (unsigned i = 0; i < shim::lane_id(); ++i) s = s + a[i];
  return s;
}

}  // namespace metal

using namespace metal;

namespace shim {

struct MetalAttrs {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
      threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size, grid_origin,
      dispatch_threads_per_threadgroup;
  unsigned thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup,
      simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width,
      quadgroup_index_in_threadgroup, thread_index_in_quadgroup, quadgroups_per_threadgroup,
      dispatch_simdgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

inline MetalAttrs metal_attrs() {
  const Fiber& f = me();
  MetalAttrs a{};
  a.thread_position_in_threadgroup = {f.tid.x, f.tid.y, f.tid.z};
  a.threadgroup_position_in_grid = {L->tg_pos.x, L->tg_pos.y, L->tg_pos.z};
  a.threads_per_threadgroup = {L->tg.x, L->tg.y, L->tg.z};
  a.dispatch_threads_per_threadgroup = a.threads_per_threadgroup;
  a.threadgroups_per_grid = {L->ntg.x, L->ntg.y, L->ntg.z};
  a.threads_per_grid = {L->grid_threads.x, L->grid_threads.y, L->grid_threads.z};
  a.grid_size = a.threads_per_grid;
  a.grid_origin = {0, 0, 0};
  a.thread_position_in_grid = {L->tg_pos.x * L->tg.x + f.tid.x, L->tg_pos.y * L->tg.y + f.tid.y,
                               L->tg_pos.z * L->tg.z + f.tid.z};
  a.thread_index_in_threadgroup = f.linear;
  a.simdgroup_index_in_threadgroup = f.linear / kSimdWidth;
  a.thread_index_in_simdgroup = f.linear % kSimdWidth;
  a.simdgroups_per_threadgroup = tg_size() / kSimdWidth;
  a.dispatch_simdgroups_per_threadgroup = a.simdgroups_per_threadgroup;
  a.threads_per_simdgroup = kSimdWidth;
  a.thread_execution_width = kSimdWidth;
  a.quadgroup_index_in_threadgroup = f.linear / 4;
  a.thread_index_in_quadgroup = f.linear % 4;
  a.quadgroups_per_threadgroup = tg_size() / 4;
  a.dispatch_quadgroups_per_threadgroup = a.quadgroups_per_threadgroup;
  return a;
}

}  // namespace shim
