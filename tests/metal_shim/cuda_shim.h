// The subset of CUDA that mlxspec kernels use, as C++ on the CPU (see shim_core.h).
// Stands in for the header mx.fast.cuda_kernel puts before a kernel.
// `__shared__ T name[N]...;` declarations in a kernel body are rewritten by the emulator.

#pragma once

#include "shim_core.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __grid_constant__

struct __half {
  _Float16 v;
  __half() = default;
  __half(float f) : v(_Float16(f)) {}
  operator float() const { return float(v); }
};
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    bits = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const { return std::bit_cast<float>(uint32_t(bits) << 16); }
};

inline float __half2float(__half h) { return float(h.v); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __ushort_as_half(unsigned short u) {
  __half h;
  h.v = std::bit_cast<_Float16>(u);
  return h;
}
inline unsigned short __half_as_ushort(__half h) { return std::bit_cast<unsigned short>(h.v); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }

inline float expf(float x) { return std::exp(x); }
inline float logf(float x) { return std::log(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float fminf(float a, float b) { return std::fmin(a, b); }
inline float __fdiv_rn(float a, float b) { return a / b; }
using std::max;
using std::min;

namespace cuda::std {
using ::std::numeric_limits;
}
namespace cooperative_groups {}
#define inf cuda::std::numeric_limits<float>::infinity()

namespace shim {
struct CudaDim {
  unsigned x, y, z;
};
inline CudaDim cu_thread() { return {me().tid.x, me().tid.y, me().tid.z}; }
inline CudaDim cu_block() { return {L->tg_pos.x, L->tg_pos.y, L->tg_pos.z}; }
inline CudaDim cu_block_dim() { return {L->tg.x, L->tg.y, L->tg.z}; }
inline CudaDim cu_grid_dim() { return {L->ntg.x, L->ntg.y, L->ntg.z}; }
inline void check_full_mask(unsigned mask) {
  if (mask != 0xffffffffu) fail("warp intrinsic with a partial mask (%s): outside the emulated subset");
}
}  // namespace shim

#define threadIdx (shim::cu_thread())
#define blockIdx (shim::cu_block())
#define blockDim (shim::cu_block_dim())
#define gridDim (shim::cu_grid_dim())
constexpr int warpSize = 32;

inline void __syncthreads() { shim::threadgroup_barrier_impl(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  shim::check_full_mask(mask);
  (void)shim::simd_exchange<int>(0, "__syncwarp");
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  shim::check_full_mask(mask);
  if (width != 32) shim::fail("__shfl_xor_sync width %s%ld: outside the emulated subset", "", width);
  return shim::simd_exchange(v, "__shfl_xor_sync")[(shim::lane_id() ^ unsigned(lane_mask)) % 32];
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  shim::check_full_mask(mask);
  if (width != 32) shim::fail("__shfl_sync width %s%ld: outside the emulated subset", "", width);
  return shim::simd_exchange(v, "__shfl_sync")[unsigned(src) % 32];
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  shim::check_full_mask(mask);
  if (width != 32) shim::fail("__shfl_down_sync width %s%ld: outside the emulated subset", "", width);
  auto a = shim::simd_exchange(v, "__shfl_down_sync");
  unsigned src = shim::lane_id() + delta;
  return src < 32u ? a[src] : v;
}
