// One step of the DSpark Markov chain over a block; same algorithm and launch geometry as
// mlxspec/metal/markov_step.metal (a warp plays a simdgroup: threadIdx.x = lane,
// threadIdx.y = warp in the block, blockIdx.y = threadgroup).

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

// Gumbel noise from a counter-based hash; the reference computes the same bits in MLX.
__device__ __forceinline__ float mlxs_gumbel(unsigned s0, unsigned s1, unsigned k, unsigned v) {
  unsigned h = mlxs_fmix32((v * 0x9E3779B9u) ^ s0);
  h = mlxs_fmix32(h ^ ((k + 1u) * 0x85EBCA6Bu) ^ s1);
  const float u = (float(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
  return -logf(-logf(u));
}

__device__ __forceinline__ bool mlxs_better(float s, int i, float bs, int bi) {
  return s > bs || (s == bs && i < bi);
}

__device__ __forceinline__ float mlxs_lse_merge(float m, float l, float m2, float l2, float mn) {
  return (m > -inf ? l * expf(m - mn) : 0.0f) + (m2 > -inf ? l2 * expf(m2 - mn) : 0.0f);
}

// ---- kernel body ----
// inputs: base [B, V], w1 [V, R], w2 [V, R], prev_i int32 [PP], prev_f float [PP, 4],
//         params uint32 [7] = (V, R, k, PP, seed0, seed1, P), temp float [1]
// outputs: part_i int32 [P], part_f float [P, 4]; template constants NSG, RL
const unsigned V = params[0];
const unsigned R = params[1];
const unsigned k = params[2];
const unsigned PP = params[3];
const unsigned P = params[6];
const float T = temp[0];
const bool greedy = !(T > 0.0f);
const unsigned lane = threadIdx.x;
const unsigned sgi = threadIdx.y;
const unsigned tgi = blockIdx.y;

__shared__ int tg_prev[1];
__shared__ float tg_f[NSG][4];
__shared__ int tg_i[NSG];

if (sgi == 0) {
  float bs = -inf;
  int bi = 0x7fffffff;
  for (unsigned i = lane; i < PP; i += 32) {
    const float s = prev_f[i * 4];
    const int id = prev_i[i];
    if (mlxs_better(s, id, bs, bi)) {
      bs = s;
      bi = id;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float s2 = __shfl_xor_sync(0xffffffffu, bs, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
    if (mlxs_better(s2, i2, bs, bi)) {
      bs = s2;
      bi = i2;
    }
  }
  if (lane == 0) {
    tg_prev[0] = min(max(bi, 0), int(V) - 1);
  }
}
__syncthreads();
const unsigned prev = unsigned(tg_prev[0]);

float u[RL];
#pragma unroll
for (int j = 0; j < RL; ++j) {
  u[j] = mlxs_to_float(w1[size_t(prev) * R + lane + 32 * j]);
}

float lm = -inf;
float ll = 0.0f;
float lsc = -inf;
int lidx = 0x7fffffff;
float lss = 0.0f;
const unsigned ntiles = (V + 31) / 32;
for (unsigned t = tgi * NSG + sgi; t < ntiles; t += P * NSG) {
  float mine = 0.0f;
  for (unsigned j = 0; j < 32; ++j) {
    const unsigned v = min(t * 32 + j, V - 1);
    const size_t row = size_t(v) * R;
    float p = 0.0f;
#pragma unroll
    for (int jj = 0; jj < RL; ++jj) {
      p += mlxs_to_float(w2[row + lane + 32 * jj]) * u[jj];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      p += __shfl_xor_sync(0xffffffffu, p, o);
    }
    if (lane == j) {
      mine = p;
    }
  }
  const unsigned v = t * 32 + lane;
  if (v < V) {
    const float z = mlxs_to_float(base[size_t(k) * V + v]) + mine;
    const float s = greedy ? z : z / T;
    const float sc = greedy ? s : s + mlxs_gumbel(params[4], params[5], k, v);
    if (s > lm) {
      ll = ll * expf(lm - s) + 1.0f;
      lm = s;
    } else if (s > -inf) {
      ll += expf(s - lm);
    }
    if (mlxs_better(sc, int(v), lsc, lidx)) {
      lsc = sc;
      lidx = int(v);
      lss = s;
    }
  }
}

for (int o = 16; o > 0; o >>= 1) {
  const float m2 = __shfl_xor_sync(0xffffffffu, lm, o);
  const float l2 = __shfl_xor_sync(0xffffffffu, ll, o);
  const float mn = fmaxf(lm, m2);
  ll = mlxs_lse_merge(lm, ll, m2, l2, mn);
  lm = mn;
  const float sc2 = __shfl_xor_sync(0xffffffffu, lsc, o);
  const int i2 = __shfl_xor_sync(0xffffffffu, lidx, o);
  const float ss2 = __shfl_xor_sync(0xffffffffu, lss, o);
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
__syncthreads();
if (sgi == 0 && lane == 0) {
  float m = -inf;
  float l = 0.0f;
  float sc = -inf;
  int idx = 0x7fffffff;
  float ss = 0.0f;
  for (int g = 0; g < NSG; ++g) {
    const float mn = fmaxf(m, tg_f[g][1]);
    l = mlxs_lse_merge(m, l, tg_f[g][1], tg_f[g][2], mn);
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
