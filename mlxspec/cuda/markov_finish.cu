// Reduce each step's block partials (markov_step) to its token and draft probability; same
// algorithm as mlxspec/metal/markov_finish.metal, one warp per step.

__device__ __forceinline__ bool mlxs_better(float s, int i, float bs, int bi) {
  return s > bs || (s == bs && i < bi);
}

__device__ __forceinline__ float mlxs_lse_merge(float m, float l, float m2, float l2, float mn) {
  return (m > -inf ? l * expf(m - mn) : 0.0f) + (m2 > -inf ? l2 * expf(m2 - mn) : 0.0f);
}

// ---- kernel body ----
// inputs: part_i int32 [B, P], part_f float [B, P, 4], params uint32 [2] = (B, P)
// outputs: tokens int32 [B], probs float [B]; block (32, 1, 1), grid (32, B, 1)
const unsigned P = params[1];
const unsigned k = blockIdx.y;
const unsigned lane = threadIdx.x;
float m = -inf;
float l = 0.0f;
float sc = -inf;
int idx = 0x7fffffff;
float ss = 0.0f;
for (unsigned i = lane; i < P; i += 32) {
  const size_t o = (size_t(k) * P + i) * 4;
  const float mn = fmaxf(m, part_f[o + 1]);
  l = mlxs_lse_merge(m, l, part_f[o + 1], part_f[o + 2], mn);
  m = mn;
  const int i2 = part_i[size_t(k) * P + i];
  if (mlxs_better(part_f[o], i2, sc, idx)) {
    sc = part_f[o];
    idx = i2;
    ss = part_f[o + 3];
  }
}
for (int o = 16; o > 0; o >>= 1) {
  const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
  const float l2 = __shfl_xor_sync(0xffffffffu, l, o);
  const float mn = fmaxf(m, m2);
  l = mlxs_lse_merge(m, l, m2, l2, mn);
  m = mn;
  const float sc2 = __shfl_xor_sync(0xffffffffu, sc, o);
  const int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
  const float ss2 = __shfl_xor_sync(0xffffffffu, ss, o);
  if (mlxs_better(sc2, i2, sc, idx)) {
    sc = sc2;
    idx = i2;
    ss = ss2;
  }
}
if (lane == 0) {
  tokens[k] = idx;
  probs[k] = expf(ss - m) / l;
}
