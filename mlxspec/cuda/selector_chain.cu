// DFlash 2's path selector over a block; same algorithm and launch geometry as
// mlxspec/metal/selector_chain.metal (a warp plays a simdgroup: threadIdx.x = lane,
// threadIdx.y = candidate slot).

__device__ __forceinline__ float mlxs_to_float(float v) { return v; }
__device__ __forceinline__ float mlxs_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float mlxs_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ unsigned mlxs_fmix32(unsigned h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// The Markov kernels' Gumbel noise (same bits as mlxspec.kernels.markov.gumbel).
__device__ __forceinline__ float mlxs_gumbel(unsigned s0, unsigned s1, unsigned k, unsigned v) {
  unsigned h = mlxs_fmix32((v * 0x9E3779B9u) ^ s0);
  h = mlxs_fmix32(h ^ ((k + 1u) * 0x85EBCA6Bu) ^ s1);
  const float u = (float(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
  return -logf(-logf(u));
}

// ---- kernel body ----
// inputs: unary [n, K], ids int32 [n, K], hp [n, R], pred [V, R], succ [V, R],
//         params uint32 [7] = (n, K, R, V, seed0, seed1, anchor), temp float [1]
// outputs: tokens int32 [n], picks int32 [n], scores float [n, K]; template constant K
const unsigned n = params[0];
const unsigned R = params[2];
const unsigned V = params[3];
const float T = temp[0];
const bool greedy = !(T > 0.0f);
const unsigned lane = threadIdx.x;
const unsigned j = threadIdx.y;

__shared__ float tg_s[K];
__shared__ float tg_g[K];
__shared__ int tg_prev[1];

if (j == 0 && lane == 0) {
  tg_prev[0] = min(int(params[6]), int(V) - 1);
}
__syncthreads();
for (unsigned t = 0; t < n; ++t) {
  const unsigned prev = unsigned(tg_prev[0]);
  const unsigned c = unsigned(min(max(ids[t * K + j], 0), int(V) - 1));
  float p = 0.0f;
  for (unsigned r = lane; r < R; r += 32) {
    p += mlxs_to_float(hp[size_t(t) * R + r]) * mlxs_to_float(succ[size_t(c) * R + r]) *
         mlxs_to_float(pred[size_t(prev) * R + r]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    p += __shfl_xor_sync(0xffffffffu, p, o);
  }
  const float s = mlxs_to_float(unary[t * K + j]) + p;
  if (lane == 0) {
    tg_s[j] = s;
    tg_g[j] = greedy ? s : s / T + mlxs_gumbel(params[4], params[5], t, j);
  }
  __syncthreads();
  if (j == 0 && lane == 0) {
    int best = 0;
    float bs = tg_g[0];
    for (int i = 1; i < K; ++i) {
      if (tg_g[i] > bs) {
        bs = tg_g[i];
        best = i;
      }
    }
    for (int i = 0; i < K; ++i) {
      scores[t * K + i] = tg_s[i];
    }
    const int tok = ids[t * K + best];
    picks[t] = best;
    tokens[t] = tok;
    tg_prev[0] = min(max(tok, 0), int(V) - 1);
  }
  __syncthreads();
}
