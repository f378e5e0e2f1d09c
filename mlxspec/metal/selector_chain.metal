// DFlash 2's path selector over a block (mlxspec/kernels/selector.py), one threadgroup:
// simdgroup j owns candidate slot j of every row. Step t, with prev the previous chosen token
// (the anchor at t = 0):
//   s_j   = unary[t, j] + sum_r hp[t, r] * succ[ids[t, j], r] * pred[prev, r]
//   pick  = argmax_j s_j (greedy), else argmax_j (s_j / T + gumbel(seed, t, j))
// and the chosen id becomes the next prev. Nothing leaves the threadgroup between steps.

#include <metal_stdlib>
using namespace metal;

inline uint mlxs_fmix32(uint h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// The Markov kernels' Gumbel noise (same bits as mlxspec.kernels.markov.gumbel).
inline float mlxs_gumbel(uint s0, uint s1, uint k, uint v) {
  uint h = mlxs_fmix32((v * 0x9E3779B9u) ^ s0);
  h = mlxs_fmix32(h ^ ((k + 1u) * 0x85EBCA6Bu) ^ s1);
  const float u = (float(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
  return -log(-log(u));
}

// ---- kernel body ----
// inputs: unary [n, K], ids int32 [n, K], hp [n, R], pred [V, R], succ [V, R],
//         params uint32 [7] = (n, K, R, V, seed0, seed1, anchor), temp float [1]
// outputs: tokens int32 [n], picks int32 [n], scores float [n, K]
// template: K (candidates per row); threadgroup (32, K, 1), grid (32, K, 1)
const uint n = params[0];
const uint R = params[2];
const uint V = params[3];
const float T = temp[0];
const bool greedy = !(T > 0.0f);
const uint lane = thread_index_in_simdgroup;
const uint j = simdgroup_index_in_threadgroup;

threadgroup float tg_s[K];
threadgroup float tg_g[K];
threadgroup int tg_prev[1];

if (j == 0 && lane == 0) {
  tg_prev[0] = min(int(params[6]), int(V) - 1);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint t = 0; t < n; ++t) {
  const uint prev = uint(tg_prev[0]);
  const uint c = uint(clamp(ids[t * K + j], 0, int(V) - 1));
  float p = 0.0f;
  for (uint r = lane; r < R; r += 32) {
    p += float(hp[size_t(t) * R + r]) * float(succ[size_t(c) * R + r]) * float(pred[size_t(prev) * R + r]);
  }
  const float s = float(unary[t * K + j]) + simd_sum(p);
  if (lane == 0) {
    tg_s[j] = s;
    tg_g[j] = greedy ? s : s / T + mlxs_gumbel(params[4], params[5], t, j);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (j == 0 && lane == 0) {
    int best = 0;
    float bs = tg_g[0];
    for (int i = 1; i < K; ++i) {
      if (tg_g[i] > bs) {  // ties keep the lower slot (the higher logit), as mx.argmax
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
    tg_prev[0] = clamp(tok, 0, int(V) - 1);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
