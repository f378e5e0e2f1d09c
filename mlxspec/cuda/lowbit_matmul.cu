// y[M, N] = x[M, K] @ W[N, K]^T with W in GGUF low-bit blocks, read as stored (no repack).
// Same algorithm and launch geometry as mlxspec/metal/lowbit_matmul.metal: a warp plays the
// role of a Metal simdgroup (threadIdx.x = lane, threadIdx.y = warp in the block).

__device__ __forceinline__ float mlxs_to_float(float v) { return v; }
__device__ __forceinline__ float mlxs_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float mlxs_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T mlxs_from_float(float v);
template <>
__device__ __forceinline__ float mlxs_from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half mlxs_from_float<__half>(float v) { return __float2half(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 mlxs_from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

__device__ __forceinline__ float mlxs_half_at(const uint8_t* p) {
  return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

__device__ __forceinline__ unsigned mlxs_pow3(int n) {
  return n == 0 ? 1u : n == 1 ? 3u : n == 2 ? 9u : n == 3 ? 27u : 81u;
}

// Weights k0 .. k0+31 of one row (k0 a multiple of 32), without the block scale:
// Q1_0 +-1, Q2_0 / PQ2_0 code-1, PTQ1_0 trit-1. Returns the block scale d.
template <int QTYPE>
__device__ __forceinline__ float mlxs_decode32(const uint8_t* row, int k0, float* wv) {
  if (QTYPE == 41) {
    const uint8_t* blk = row + (k0 / 128) * 18;
    const uint8_t* bits = blk + 2 + (k0 % 128) / 8;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      wv[i] = ((bits[i / 8] >> (i % 8)) & 1) ? 1.0f : -1.0f;
    }
    return mlxs_half_at(blk);
  } else if (QTYPE == 42 || QTYPE == 142) {
    const int qk = QTYPE == 42 ? 64 : 128;
    const int nb = QTYPE == 42 ? 18 : 34;
    const uint8_t* blk = row + (k0 / qk) * nb;
    const uint8_t* codes = blk + 2 + (k0 % qk) / 4;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      wv[i] = float((codes[i / 4] >> (2 * (i % 4))) & 3) - 1.0f;
    }
    return mlxs_half_at(blk);
  } else {
    const uint8_t* blk = row + (k0 / 128) * 28;
    const int e0 = k0 % 128;
#pragma unroll
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
      const unsigned q = (unsigned(blk[b]) * mlxs_pow3(n)) & 255u;
      wv[i] = float((q * 3u) >> 8) - 1.0f;
    }
    return mlxs_half_at(blk + 26);
  }
}

// ---- kernel body ----
// inputs: x [M, K] (T), w [N, row_bytes] uint8, params int32 [4] = (M, N, K, row_bytes)
// output: y [M, N] (T); template constants T, QTYPE, TM, RPS (see the Metal source)
const int M = params[0];
const int N = params[1];
const int K = params[2];
const int RB = params[3];
const int lane = int(threadIdx.x);
const int sg = int(blockIdx.y * blockDim.y + threadIdx.y);
const int n0 = sg * RPS;
const int m0 = int(blockIdx.z) * TM;
if (n0 >= N) {
  return;
}
float acc[TM][RPS];
#pragma unroll
for (int m = 0; m < TM; ++m) {
#pragma unroll
  for (int r = 0; r < RPS; ++r) {
    acc[m][r] = 0.0f;
  }
}
float wv[32];
for (int k0 = lane * 32; k0 < K; k0 += 32 * 32) {
#pragma unroll
  for (int r = 0; r < RPS; ++r) {
    const int n = min(n0 + r, N - 1);
    const float d = mlxs_decode32<QTYPE>(w + size_t(n) * size_t(RB), k0, wv);
#pragma unroll
    for (int m = 0; m < TM; ++m) {
      const T* xr = x + size_t(min(m0 + m, M - 1)) * size_t(K) + size_t(k0);
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        s += mlxs_to_float(xr[i]) * wv[i];
      }
      acc[m][r] += d * s;
    }
  }
}
#pragma unroll
for (int m = 0; m < TM; ++m) {
#pragma unroll
  for (int r = 0; r < RPS; ++r) {
    float v = acc[m][r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    if (lane == 0 && m0 + m < M && n0 + r < N) {
      y[size_t(m0 + m) * size_t(N) + size_t(n0 + r)] = mlxs_from_float<T>(v);
    }
  }
}
