// Reduce each step's threadgroup partials (markov_step) to its token and draft probability:
// tokens[k] = best index, probs[k] = exp(s_best - m) / sum exp(s - m) over the whole vocabulary.

#include <metal_stdlib>
using namespace metal;

inline bool mlxs_better(float s, int i, float bs, int bi) {
  return s > bs || (s == bs && i < bi);
}

// ---- kernel body ----
// inputs: part_i int32 [B, P], part_f float [B, P, 4], params uint32 [2] = (B, P)
// outputs: tokens int32 [B], probs float [B]
// threadgroup (32, 1, 1), grid (32, B, 1): one simdgroup per step
const uint P = params[1];
const uint k = threadgroup_position_in_grid.y;
const uint lane = thread_index_in_simdgroup;
float m = -INFINITY;
float l = 0.0f;
float sc = -INFINITY;
int idx = 0x7fffffff;
float ss = 0.0f;
for (uint i = lane; i < P; i += 32) {
  const size_t o = (size_t(k) * P + i) * 4;
  const float m2 = part_f[o + 1];
  const float mn = max(m, m2);
  l = (m > -INFINITY ? l * exp(m - mn) : 0.0f) + (m2 > -INFINITY ? part_f[o + 2] * exp(m2 - mn) : 0.0f);
  m = mn;
  const int i2 = part_i[size_t(k) * P + i];
  if (mlxs_better(part_f[o], i2, sc, idx)) {
    sc = part_f[o];
    idx = i2;
    ss = part_f[o + 3];
  }
}
for (ushort o = 16; o > 0; o >>= 1) {
  const float m2 = simd_shuffle_xor(m, o);
  const float l2 = simd_shuffle_xor(l, o);
  const float mn = max(m, m2);
  l = (m > -INFINITY ? l * exp(m - mn) : 0.0f) + (m2 > -INFINITY ? l2 * exp(m2 - mn) : 0.0f);
  m = mn;
  const float sc2 = simd_shuffle_xor(sc, o);
  const int i2 = simd_shuffle_xor(idx, o);
  const float ss2 = simd_shuffle_xor(ss, o);
  if (mlxs_better(sc2, i2, sc, idx)) {
    sc = sc2;
    idx = i2;
    ss = ss2;
  }
}
if (lane == 0) {
  tokens[k] = idx;
  probs[k] = exp(ss - m) / l;
}
