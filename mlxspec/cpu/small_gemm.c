/* cblas_sgemm for the shapes of a decode or verify step on an x86-64 CPU: C = alpha * A @ B^T +
   beta * C, A [M, K] row-major, B stored [N, K] row-major (an nn.Linear weight, B^T as MLX passes
   it), 1 <= M <= max_rows. Anything else, or OpenBLAS on more than one thread, goes to the
   cblas_sgemm this one stands in front of (mlxspec/cpu_gemm.py loads it before OpenBLAS).

   Why: OpenBLAS packs B for every GEMM; with a few rows that packing, not the arithmetic, is the
   cost, and the weights stream from memory once per step either way. Here each weight row is
   read once, straight from memory, and multiplied with every row of A held in cache: R weight
   rows x M activation rows of 16-lane accumulators, reduced once per output, while the next R
   rows are prefetched (without it, 9 rows cost ~1.8x as much: the stream stalled on the FMAs).

   Each output C[m, n] sums its products in the same order whatever M is, so a verify row equals
   the decode step of the same token bit for bit (OpenBLAS's kernels differ between M = 1 and
   M > 1). Built by cc -O3 -march=native; without AVX-512 it only forwards. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

enum { RowMajor = 101, NoTrans = 111, Trans = 112 };
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef int (*threads_fn)(void);
static sgemm_fn next_sgemm;
static threads_fn blas_threads;
static int max_rows = 16;
/* products computed here; static, so a second copy loaded beside a preloaded one counts its own
   (an exported variable would be interposed by the first copy in the global scope) */
static long calls;

long mlxspec_small_gemm_calls(void) { return __atomic_load_n(&calls, __ATOMIC_RELAXED); }

/* fallback: the cblas_sgemm to forward to (NULL: the next one in the symbol search order);
   threads: openblas_get_num_threads or NULL; rows: the largest M computed here (0: none). */
void mlxspec_small_gemm_init(void *fallback, void *threads, int rows) {
    next_sgemm = (sgemm_fn)fallback;
    blas_threads = (threads_fn)threads;
    max_rows = rows;
}

int mlxspec_small_gemm_available(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
#include <immintrin.h>

__attribute__((always_inline)) static inline void block(int M, int R, int n, int K, float alpha, const float *A,
                                                        int lda, const float *B, int ldb, float beta, float *C,
                                                        int ldc) {
    __m512 acc[4][16];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    int K16 = K & ~15;
    for (int k = 0; k < K16; k += 16) {
        __m512 w[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {  /* and the next block's rows into cache (a prefetch never faults) */
            w[r] = _mm512_loadu_ps(B + (size_t)(n + r) * ldb + k);
            _mm_prefetch((const char *)(B + (size_t)(n + r + R) * ldb + k), _MM_HINT_T0);
        }
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            __m512 a = _mm512_loadu_ps(A + (size_t)m * lda + k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][m] = _mm512_fmadd_ps(w[r], a, acc[r][m]);
        }
    }
    if (K16 < K) {  /* the tail: masked loads, the same accumulators */
        __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1);
        __m512 w[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) w[r] = _mm512_maskz_loadu_ps(tail, B + (size_t)(n + r) * ldb + K16);
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            __m512 a = _mm512_maskz_loadu_ps(tail, A + (size_t)m * lda + K16);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][m] = _mm512_fmadd_ps(w[r], a, acc[r][m]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            float s = _mm512_reduce_add_ps(acc[r][m]);
            float *c = C + (size_t)m * ldc + n + r;
            *c = beta == 0.f ? alpha * s : alpha * s + beta * *c;
        }
}

__attribute__((always_inline)) static inline void rows(int M, int R, int N, int K, float alpha, const float *A,
                                                       int lda, const float *B, int ldb, float beta, float *C,
                                                       int ldc) {
    int n = 0;
    for (; n + R <= N; n += R) block(M, R, n, K, alpha, A, lda, B, ldb, beta, C, ldc);
    for (; n < N; n++) block(M, 1, n, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

#define CASE(m, r) \
    case m:        \
        rows(m, r, N, K, alpha, A, lda, B, ldb, beta, C, ldc); \
        return 1;

static int small(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc) {
    switch (M) {
        CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(5, 4) CASE(6, 4) CASE(7, 3) CASE(8, 3)
        CASE(9, 2) CASE(10, 2) CASE(11, 2) CASE(12, 2) CASE(13, 1) CASE(14, 1) CASE(15, 1) CASE(16, 1)
    }
    return 0;
}
#endif

static int threads_looked_up;

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
#ifdef __AVX512F__
    if (!blas_threads && !threads_looked_up) {  /* preloaded (LD_PRELOAD) rather than attached: find it */
        blas_threads = (threads_fn)dlsym(RTLD_DEFAULT, "openblas_get_num_threads");
        threads_looked_up = 1;
    }
    if (order == RowMajor && ta == NoTrans && tb == Trans && M >= 1 && M <= max_rows && N >= 1 && K >= 1 &&
        lda >= K && ldb >= K && ldc >= N && (blas_threads == NULL || blas_threads() <= 1) &&
        small(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) {
        __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
        return;
    }
#endif
    if (!next_sgemm) next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    next_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
