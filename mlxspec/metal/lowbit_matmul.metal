// y[M, N] = x[M, K] @ W[N, K]^T with W in GGUF low-bit blocks, read as stored (no repack).
// Block layouts: mlxspec/gguf/quants.py. Kept inside the emulator subset
// (mlxspec/kernels/README.md): scalar types, simd_sum, no vector types.

#include <metal_stdlib>
using namespace metal;

constant uint mlxs_pow3[5] = {1, 3, 9, 27, 81};

inline float mlxs_half_at(const device uint8_t* p) {
  return float(as_type<half>(ushort(ushort(p[0]) | (ushort(p[1]) << 8))));
}

// Weights k0 .. k0+31 of one row (k0 a multiple of 32), without the block scale:
// Q1_0 +-1, Q2_0 / PQ2_0 code-1, PTQ1_0 trit-1. Returns the block scale d.
template <int QTYPE>
inline float mlxs_decode32(const device uint8_t* row, int k0, thread float* wv) {
  if (QTYPE == 41) {  // Q1_0: 128 weights / 18 bytes, d then sign bits LSB first
    const device uint8_t* blk = row + (k0 / 128) * 18;
    const device uint8_t* bits = blk + 2 + (k0 % 128) / 8;
    for (int i = 0; i < 32; ++i) {
      wv[i] = ((bits[i / 8] >> (i % 8)) & 1) ? 1.0f : -1.0f;
    }
    return mlxs_half_at(blk);
  } else if (QTYPE == 42 || QTYPE == 142) {  // Q2_0 (64 / 18 B), PQ2_0 (128 / 34 B)
    const int qk = QTYPE == 42 ? 64 : 128;
    const int nb = QTYPE == 42 ? 18 : 34;
    const device uint8_t* blk = row + (k0 / qk) * nb;
    const device uint8_t* codes = blk + 2 + (k0 % qk) / 4;
    for (int i = 0; i < 32; ++i) {
      wv[i] = float((codes[i / 4] >> (2 * (i % 4))) & 3) - 1.0f;
    }
    return mlxs_half_at(blk);
  } else {  // PTQ1_0: 128 weights / 28 bytes: qs[24] five trits, qh[2] four trits, d last
    const device uint8_t* blk = row + (k0 / 128) * 28;
    const int e0 = k0 % 128;
    for (int i = 0; i < 32; ++i) {
      const int e = e0 + i;
      int b;
      int n;
      if (e < 80) {
        b = e & 15;
        n = e >> 4;
      } else if (e < 120) {
        b = 16 + ((e - 80) & 7);
        n = (e - 80) >> 3;
      } else {
        b = 24 + ((e - 120) & 1);
        n = (e - 120) >> 1;
      }
      const uint q = (uint(blk[b]) * mlxs_pow3[n]) & 255u;
      wv[i] = float((q * 3u) >> 8) - 1.0f;
    }
    return mlxs_half_at(blk + 26);
  }
}

// ---- kernel body ----
// inputs: x [M, K] (T), w [N, row_bytes] uint8, params int32 [4] = (M, N, K, row_bytes)
// output: y [M, N] (T)
// template: T, QTYPE (GGUF type id), TM (activation rows per pass), RPS (rows per simdgroup)
// threadgroup (32, NSG, 1); grid (32, NSG * groups, ceil(M / TM)). Simdgroup s of the grid
// owns output rows s*RPS .. s*RPS+RPS-1; its lanes split K in chunks of 32 weights.
const int M = params[0];
const int N = params[1];
const int K = params[2];
const int RB = params[3];
const int lane = int(thread_index_in_simdgroup);
const int sg = int(threadgroup_position_in_grid.y * (threads_per_threadgroup.y) + simdgroup_index_in_threadgroup);
const int n0 = sg * RPS;
const int m0 = int(threadgroup_position_in_grid.z) * TM;
if (n0 >= N) {
  return;  // the whole simdgroup leaves together
}
float acc[TM][RPS];
for (int m = 0; m < TM; ++m) {
  for (int r = 0; r < RPS; ++r) {
    acc[m][r] = 0.0f;
  }
}
float wv[32];
for (int k0 = lane * 32; k0 < K; k0 += 32 * 32) {
  for (int r = 0; r < RPS; ++r) {
    const int n = min(n0 + r, N - 1);  // past the last row: computed, not written
    const float d = mlxs_decode32<QTYPE>(w + size_t(n) * size_t(RB), k0, wv);
    for (int m = 0; m < TM; ++m) {
      const device T* xr = x + size_t(min(m0 + m, M - 1)) * size_t(K) + size_t(k0);
      float s = 0.0f;
      for (int i = 0; i < 32; ++i) {
        s += float(xr[i]) * wv[i];
      }
      acc[m][r] += d * s;
    }
  }
}
for (int m = 0; m < TM; ++m) {
  for (int r = 0; r < RPS; ++r) {
    const float v = simd_sum(acc[m][r]);
    if (lane == 0 && m0 + m < M && n0 + r < N) {
      y[size_t(m0 + m) * size_t(N) + size_t(n0 + r)] = static_cast<T>(v);
    }
  }
}
