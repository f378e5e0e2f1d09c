/* Two elementwise pieces of a target forward on an x86-64 CPU, equal bit for bit to what MLX
   computes for them, and an order of magnitude faster: the attention softmax (MLX's
   mlx/backend/cpu/softmax.cpp) and the SwiGLU activation (mlx-lm's compiled `swiglu`, silu(g) * x,
   with MLX's Sigmoid from mlx/backend/cpu/unary_ops.h). The MLX wheel for x86-64 computes their
   exp one element at a time (its SIMD width there is 1) with a call into libm for every fma:
   ~13 ns an element for the softmax, ~27 for the compiled SwiGLU, on a 2-core Xeon. In
   SmolLM2-135M at context 300 a 9-row verify spends ~11 ms of ~75 in the softmax and ~9 in
   the SwiGLU (docs/cli.md).

   What makes them the same numbers, element for element:
   - exp: MLX's operations in MLX's order: x * log2(e) in float, floor(x + 0.5) in double
     (MLX adds the double 0.5 to the float), the same Cephes polynomial by fused multiply-adds,
     2^ipart from the exponent bits, the same NaN / +-88 selects. Vector lanes compute exactly
     what the scalar code computes; -ffp-contract=off keeps the compiler from fusing anything
     else.
   - softmax: the row's maximum (exact in any order); the normalizer summed strictly left to
     right from 0 (a float sum depends on its order), then 1 / sum, and every exponential
     multiplied by it. Masked scores (the causal mask MLX builds in its attention fallback) are
     replaced by the float's lowest value, as MLX's where(mask, scores, finfo.min) does.
   - SwiGLU: sigmoid(g) = g < 0 ? y : 1 - y with y = 1 / (1 + exp(|g|)), then (g * sigmoid(g)) * x,
     each rounded to float as the compiled kernel rounds it.

   mlxspec_softmax_rows(x, rows, n, q_rows, causal_from): x holds rows x n floats, softmaxed in
   place; causal_from < 0: no mask; otherwise row r keeps columns 0 .. causal_from + (r % q_rows)
   (a row's query position is its index within its head's q_rows rows).
   mlxspec_swiglu(g, x, out, n): out = silu(g) * x over n floats.
   Built by cc -O3 -march=native -ffp-contract=off (mlxspec.targets.host_math). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* MLX's polynomial for 2^f on [-0.5, 0.5], by fused multiply-adds from the highest term */
#define POLY(p, f, FMA, SET1)                                 \
    do {                                                      \
        p = SET1(1.535336188319500e-4f);                      \
        p = FMA(p, f, SET1(1.339887440266574e-3f));           \
        p = FMA(p, f, SET1(9.618437357674640e-3f));           \
        p = FMA(p, f, SET1(5.550332471162809e-2f));           \
        p = FMA(p, f, SET1(2.402264791363012e-1f));           \
        p = FMA(p, f, SET1(6.931472028550421e-1f));           \
        p = FMA(p, f, SET1(1.000000000000000f));              \
    } while (0)

static inline float exp1(float x_init) {
    float x = x_init * 1.442695f;
    float ipart = (float)floor((double)x + 0.5);
    float fpart = x - ipart;
    POLY(x, fpart, fmaf, (float));
    if (x_init != x_init) return x_init;
    if (x_init > 88.0f) return INFINITY;
    if (x_init < -88.0f) return 0.0f;
    uint32_t bits = (uint32_t)((int32_t)ipart + 127) << 23;
    float two;
    memcpy(&two, &bits, 4);
    return two * x;
}

#if defined(__AVX512F__)
#define LANES 16
static inline __m512 expv(__m512 xi) {
    __m512 x = _mm512_mul_ps(xi, _mm512_set1_ps(1.442695f));
    const __m512d half = _mm512_set1_pd(0.5);
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    lo = _mm512_roundscale_pd(_mm512_add_pd(lo, half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    hi = _mm512_roundscale_pd(_mm512_add_pd(hi, half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 ipart = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo))),
                                                       _mm256_castps_pd(_mm512_cvtpd_ps(hi)), 1));
    __m512 f = _mm512_sub_ps(x, ipart);
    __m512 p;
    POLY(p, f, _mm512_fmadd_ps, _mm512_set1_ps);
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(ipart), _mm512_set1_epi32(127)), 23);
    __m512 r = _mm512_mul_ps(_mm512_castsi512_ps(e), p);
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xi, xi, _CMP_UNORD_Q), r, xi);
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xi, _mm512_set1_ps(88.0f), _CMP_GT_OQ), r, _mm512_set1_ps(INFINITY));
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xi, _mm512_set1_ps(-88.0f), _CMP_LT_OQ), r, _mm512_setzero_ps());
    return r;
}
#define LOAD _mm512_loadu_ps
#define STORE _mm512_storeu_ps
#define SET1 _mm512_set1_ps
#define MUL _mm512_mul_ps
#define SUB _mm512_sub_ps
#define MAX _mm512_max_ps
#define ADD _mm512_add_ps
#define DIV _mm512_div_ps
#define ABS _mm512_abs_ps
#define NEG_SELECT(g, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), b, a)
typedef __m512 vec;
static inline float hmax(vec v) { return _mm512_reduce_max_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
static inline __m256 expv(__m256 xi) {
    __m256 x = _mm256_mul_ps(xi, _mm256_set1_ps(1.442695f));
    const __m256d half = _mm256_set1_pd(0.5);
    __m256d lo = _mm256_floor_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), half));
    __m256d hi = _mm256_floor_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), half));
    __m256 ipart = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(lo)), _mm256_cvtpd_ps(hi), 1);
    __m256 f = _mm256_sub_ps(x, ipart);
    __m256 p;
    POLY(p, f, _mm256_fmadd_ps, _mm256_set1_ps);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
    __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(e), p);
    r = _mm256_blendv_ps(r, xi, _mm256_cmp_ps(xi, xi, _CMP_UNORD_Q));
    r = _mm256_blendv_ps(r, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(xi, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
    r = _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(xi, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
    return r;
}
#define LOAD _mm256_loadu_ps
#define STORE _mm256_storeu_ps
#define SET1 _mm256_set1_ps
#define MUL _mm256_mul_ps
#define SUB _mm256_sub_ps
#define MAX _mm256_max_ps
#define ADD _mm256_add_ps
#define DIV _mm256_div_ps
#define ABS(v) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v)
#define NEG_SELECT(g, a, b) _mm256_blendv_ps(b, a, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ))
typedef __m256 vec;
static inline float hmax(vec v) {
    float t[8], m = -INFINITY;
    _mm256_storeu_ps(t, v);
    for (int i = 0; i < 8; i++) m = t[i] > m ? t[i] : m;
    return m;
}
#endif

/* the lanes it computes with (16: AVX-512F, 8: AVX2 + FMA, 1: scalar) */
int mlxspec_math_lanes(void) {
#ifdef LANES
    return LANES;
#else
    return 1;
#endif
}

static void row(float *x, long n) {
    long j = 0;
    float m = -INFINITY;
#ifdef LANES
    vec vm = SET1(-INFINITY);
    for (; j + LANES <= n; j += LANES) vm = MAX(vm, LOAD(x + j));
    m = hmax(vm);
#endif
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    j = 0;
#ifdef LANES
    vec vmv = SET1(m);
    for (; j + LANES <= n; j += LANES) STORE(x + j, expv(SUB(LOAD(x + j), vmv)));
#endif
    for (; j < n; j++) x[j] = exp1(x[j] - m);
    float s = 0.0f;
    for (j = 0; j < n; j++) s = s + x[j];  /* left to right, as MLX sums */
    s = 1 / s;
    j = 0;
#ifdef LANES
    vec vs = SET1(s);
    for (; j + LANES <= n; j += LANES) STORE(x + j, MUL(LOAD(x + j), vs));
#endif
    for (; j < n; j++) x[j] = x[j] * s;
}

void mlxspec_softmax_rows(float *x, long rows, long n, long q_rows, long causal_from) {
    for (long r = 0; r < rows; r++, x += n) {
        if (causal_from >= 0) {
            long keep = causal_from + (r % q_rows) + 1;
            for (long j = keep; j < n; j++) x[j] = -FLT_MAX;
        }
        row(x, n);
    }
}

static inline float sigmoid1(float g) {
    float y = 1.0f / (1.0f + exp1(fabsf(g)));
    return g < 0 ? y : 1.0f - y;
}

void mlxspec_swiglu(const float *g, const float *x, float *out, long n) {
    long i = 0;
#ifdef LANES
    const vec one = SET1(1.0f);
    for (; i + LANES <= n; i += LANES) {
        vec gv = LOAD(g + i);
        vec y = DIV(one, ADD(one, expv(ABS(gv))));
        vec sig = NEG_SELECT(gv, y, SUB(one, y)); /* g < 0 ? y : 1 - y */
        STORE(out + i, MUL(MUL(gv, sig), LOAD(x + i)));
    }
#endif
    for (; i < n; i++) out[i] = (g[i] * sigmoid1(g[i])) * x[i];
}
