// One step k of the DSpark Markov chain over a block (mlxspec/kernels/markov.py):
//   prev  = argmax of the previous step's partials (the anchor at step 0)
//   z_v   = base[k, v] + sum_j w2[v, j] * w1[prev, j]
//   s_v   = z_v / T (z_v when greedy), score_v = s_v + gumbel(seed, k, v) (s_v when greedy)
// and per threadgroup: the best (score, index, s), the max m of s and sum exp(s - m).
// W2 is read once; nothing of size V is written.

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

// Gumbel noise from a counter-based hash; the reference computes the same bits in MLX.
inline float mlxs_gumbel(uint s0, uint s1, uint k, uint v) {
  uint h = mlxs_fmix32((v * 0x9E3779B9u) ^ s0);
  h = mlxs_fmix32(h ^ ((k + 1u) * 0x85EBCA6Bu) ^ s1);
  const float u = (float(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
  return -log(-log(u));
}

// (score, index) order: higher score first, then lower index (mx.argmax keeps the first).
inline bool mlxs_better(float s, int i, float bs, int bi) {
  return s > bs || (s == bs && i < bi);
}

// ---- kernel body ----
// inputs: base [B, V], w1 [V, R], w2 [V, R], prev_i int32 [PP], prev_f float [PP, 4],
//         params uint32 [7] = (V, R, k, PP, seed0, seed1, P), temp float [1]
// outputs: part_i int32 [P], part_f float [P, 4] = (score, m, l, s) of each threadgroup
// template: NSG (simdgroups per threadgroup), RL = R / 32
// threadgroup (32, NSG, 1), grid (32, NSG * P, 1)
const uint V = params[0];
const uint R = params[1];
const uint k = params[2];
const uint PP = params[3];
const uint P = params[6];
const float T = temp[0];
const bool greedy = !(T > 0.0f);
const uint lane = thread_index_in_simdgroup;
const uint sgi = simdgroup_index_in_threadgroup;
const uint tgi = threadgroup_position_in_grid.y;

threadgroup int tg_prev[1];
threadgroup float tg_f[NSG][4];
threadgroup int tg_i[NSG];

// 1. The previous token: best of the previous step's partials.
if (sgi == 0) {
  float bs = -INFINITY;
  int bi = 0x7fffffff;
  for (uint i = lane; i < PP; i += 32) {
    const float s = prev_f[i * 4];
    const int id = prev_i[i];
    if (mlxs_better(s, id, bs, bi)) {
      bs = s;
      bi = id;
    }
  }
  for (ushort o = 16; o > 0; o >>= 1) {
    const float s2 = simd_shuffle_xor(bs, o);
    const int i2 = simd_shuffle_xor(bi, o);
    if (mlxs_better(s2, i2, bs, bi)) {
      bs = s2;
      bi = i2;
    }
  }
  if (lane == 0) {
    tg_prev[0] = clamp(bi, 0, int(V) - 1);
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const uint prev = uint(tg_prev[0]);

// 2. This lane's slice of W1[prev]: elements lane, lane + 32, ...
float u[RL];
for (int j = 0; j < RL; ++j) {
  u[j] = float(w1[size_t(prev) * R + lane + 32 * j]);
}

// 3. Tiles of 32 rows: each row's dot product is a simd_sum; lane j keeps row j's value.
float lm = -INFINITY;  // max of s
float ll = 0.0f;       // sum of exp(s - lm)
float lsc = -INFINITY; // best score
int lidx = 0x7fffffff; // its row
float lss = 0.0f;      // its s
const uint ntiles = (V + 31) / 32;
for (uint t = tgi * NSG + sgi; t < ntiles; t += P * NSG) {
  float mine = 0.0f;
  for (uint j = 0; j < 32; ++j) {
    const uint v = min(t * 32 + j, V - 1);
    const size_t row = size_t(v) * R;
    float p = 0.0f;
    for (int jj = 0; jj < RL; ++jj) {
      p += float(w2[row + lane + 32 * jj]) * u[jj];
    }
    const float b = simd_sum(p);
    if (lane == j) {
      mine = b;
    }
  }
  const uint v = t * 32 + lane;
  if (v < V) {
    const float z = float(base[size_t(k) * V + v]) + mine;
    const float s = greedy ? z : z / T;
    const float sc = greedy ? s : s + mlxs_gumbel(params[4], params[5], k, v);
    if (s > lm) {
      ll = ll * exp(lm - s) + 1.0f;
      lm = s;
    } else if (s > -INFINITY) {
      ll += exp(s - lm);
    }
    if (mlxs_better(sc, int(v), lsc, lidx)) {
      lsc = sc;
      lidx = int(v);
      lss = s;
    }
  }
}

// 4. Combine the lanes (butterfly: every lane ends with the same values), then the simdgroups.
for (ushort o = 16; o > 0; o >>= 1) {
  const float m2 = simd_shuffle_xor(lm, o);
  const float l2 = simd_shuffle_xor(ll, o);
  const float mn = max(lm, m2);
  ll = (lm > -INFINITY ? ll * exp(lm - mn) : 0.0f) + (m2 > -INFINITY ? l2 * exp(m2 - mn) : 0.0f);
  lm = mn;
  const float sc2 = simd_shuffle_xor(lsc, o);
  const int i2 = simd_shuffle_xor(lidx, o);
  const float ss2 = simd_shuffle_xor(lss, o);
  if (mlxs_better(sc2, i2, lsc, lidx)) {
    lsc = sc2;
    lidx = i2;
    lss = ss2;
  }
}
if (lane == 0) {
  tg_f[sgi][0] = lsc;
  tg_f[sgi][1] = lm;
  tg_f[sgi][2] = ll;
  tg_f[sgi][3] = lss;
  tg_i[sgi] = lidx;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (sgi == 0 && lane == 0) {
  float m = -INFINITY;
  float l = 0.0f;
  float sc = -INFINITY;
  int idx = 0x7fffffff;
  float ss = 0.0f;
  for (int g = 0; g < NSG; ++g) {
    const float m2 = tg_f[g][1];
    const float mn = max(m, m2);
    l = (m > -INFINITY ? l * exp(m - mn) : 0.0f) + (m2 > -INFINITY ? tg_f[g][2] * exp(m2 - mn) : 0.0f);
    m = mn;
    if (mlxs_better(tg_f[g][0], tg_i[g], sc, idx)) {
      sc = tg_f[g][0];
      idx = tg_i[g];
      ss = tg_f[g][3];
    }
  }
  part_f[tgi * 4 + 0] = sc;
  part_f[tgi * 4 + 1] = m;
  part_f[tgi * 4 + 2] = l;
  part_f[tgi * 4 + 3] = ss;
  part_i[tgi] = idx;
}
