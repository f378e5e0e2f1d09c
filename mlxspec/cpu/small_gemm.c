/* cblas_sgemm for the shapes of a decode or verify step on an x86-64 CPU: C = alpha * A @ B^T +
   beta * C, A [M, K] row-major, B stored [N, K] row-major (an nn.Linear weight, B^T as MLX passes
   it), 1 <= M <= max_rows and the kernel's rows (24; while OpenBLAS runs more than one thread: M <= threaded_rows); and
   C = alpha * A @ B + beta * C with B stored [K, N] (attention's P @ V) for the same M and N <= 512 (small_nn). Anything
   else goes to the cblas_sgemm this one stands in front of (mlxspec/cpu_gemm.py loads it before OpenBLAS).

   Why: OpenBLAS packs B for every GEMM; with a few rows that packing, not the arithmetic, is the
   cost, and the weights stream from memory once per step either way. Here each weight row is
   read once, straight from memory, and multiplied with every row of A held in cache: R weight
   rows x M activation rows of 16-lane (AVX-512F) or 8-lane (AVX2 + FMA) accumulators, reduced once per output, while the next R
   rows are prefetched (without it, 9 rows cost ~1.8x as much: the stream stalled on the FMAs).

   Each output C[m, n] sums its products in the same order whatever M is, so a verify row equals
   the decode step of the same token bit for bit (OpenBLAS's kernels differ between M = 1 and
   M > 1). Built by cc -O3 -march=native; without AVX-512F or AVX2 + FMA it only forwards. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

enum { RowMajor = 101, NoTrans = 111, Trans = 112 };
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef int (*threads_fn)(void);
static sgemm_fn next_sgemm;
static threads_fn blas_threads;
static int max_rows = 24; /* capped by KERNEL_ROWS; mlxspec_small_gemm_init sets it (LD_PRELOAD: never called) */
/* the largest M computed here while OpenBLAS runs more than one thread (split over two cores,
   `split`): every product it computes (24 rows); one core of ours alone had beaten OpenBLAS's two
   threads up to 12 rows on a 2-core AVX2 EPYC (SmolLM2-135M, a forward of 1 row 73 ms against
   110, 12 rows 217 against 273, 16 rows 252 against 213: scripts/gemm_rows.py, docs/cli.md) */
static int threaded_rows = 24;

void mlxspec_small_gemm_set_threaded_rows(int rows) { threaded_rows = rows; }
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

/* the vector width it computes with: 16 lanes (AVX-512F), 8 (AVX2 with FMA), 0 (neither: it only forwards) */
#if defined(__AVX512F__)
#define SMALL_GEMM 16
#elif defined(__AVX2__) && defined(__FMA__)
#define SMALL_GEMM 8
#endif

int mlxspec_small_gemm_lanes(void) {
#ifdef SMALL_GEMM
    return SMALL_GEMM;
#else
    return 0;
#endif
}

int mlxspec_small_gemm_available(void) { return mlxspec_small_gemm_lanes() > 0; }

#ifdef SMALL_GEMM
#include <immintrin.h>

#if SMALL_GEMM == 16
#define KERNEL_ROWS 24 /* the most activation rows `small` computes (groups of 8 above 8) */
typedef __m512 vec;
typedef __mmask16 tailmask;
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_TAIL(rest) ((__mmask16)((1u << (rest)) - 1))
#define V_LOAD_TAIL(m, p) _mm512_maskz_loadu_ps(m, p)
#define V_SUM(v) _mm512_reduce_add_ps(v)
#define V_SET1(x) _mm512_set1_ps(x)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#else
/* AVX2: 16 vector registers (AVX-512 has 32), so fewer weight rows per block (the CASE table);
   up to 24 rows in groups of 4 (a lookup's 16 drafts verify 17 rows) */
#define KERNEL_ROWS 24
typedef __m256 vec;
typedef __m256i tailmask;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_TAIL(rest) _mm256_cmpgt_epi32(_mm256_set1_epi32(rest), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define V_LOAD_TAIL(m, p) _mm256_maskload_ps(p, m)
#define V_SET1(x) _mm256_set1_ps(x)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
static inline float V_SUM(__m256 v) { /* a fixed order: the same sum whatever M is */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

__attribute__((always_inline)) static inline void block(int M, int R, int n, int K, float alpha, const float *A,
                                                        int lda, const float *B, int ldb, float beta, float *C,
                                                        int ldc) {
    vec acc[4][16];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) acc[r][m] = V_ZERO();
    int KV = K & ~(SMALL_GEMM - 1);
    for (int k = 0; k < KV; k += SMALL_GEMM) {
        vec w[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {  /* and the next block's rows into cache (a prefetch never faults) */
            w[r] = V_LOAD(B + (size_t)(n + r) * ldb + k);
            _mm_prefetch((const char *)(B + (size_t)(n + r + R) * ldb + k), _MM_HINT_T0);
        }
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            vec a = V_LOAD(A + (size_t)m * lda + k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][m] = V_FMA(w[r], a, acc[r][m]);
        }
    }
    if (KV < K) {  /* the tail: masked loads, the same accumulators */
        tailmask tail = V_TAIL(K - KV);
        vec w[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) w[r] = V_LOAD_TAIL(tail, B + (size_t)(n + r) * ldb + KV);
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            vec a = V_LOAD_TAIL(tail, A + (size_t)m * lda + KV);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][m] = V_FMA(w[r], a, acc[r][m]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            float s = V_SUM(acc[r][m]);
            float *c = C + (size_t)m * ldc + n + r;
            *c = beta == 0.f ? alpha * s : alpha * s + beta * *c;
        }
}

/* AVX2 above 4 rows: R weight rows against 4 activation rows at a time (12 accumulators, 3
   weights and one A row: the 16 registers), the block's weight rows read back from L1 for each
   group of 4, so no accumulator spills; each output's sum is the same as with all rows at once.
   AVX-512 (32 registers): up to 12 rows in one block; above 12, groups of 8 against 3 weight rows
   (24 accumulators). One block of 13-16 rows took one weight row at a time (SmolLM2's GEMMs over
   16 rows: 47 ms against 41-45 in groups, 25 over one row), and 17-24 rows went to OpenBLAS
   (17 rows: 83 ms against 44-46 here; a verify of 17 rows cost 3.2 one-row steps in mlxspec
   bench's curve, 2026-12-05, a 2-core Xeon with AVX-512; docs/cli.md, scripts/gemm_rows.py). */
#define GROUP(m)                                                                                    \
    block(m, R, n, K, alpha, A + (size_t)m0 * lda, lda, B, ldb, beta, C + (size_t)m0 * ldc, ldc)
__attribute__((always_inline)) static inline void groups(int M, int R, int n, int K, float alpha, const float *A,
                                                         int lda, const float *B, int ldb, float beta, float *C,
                                                         int ldc) {
    int m0 = 0;
#if SMALL_GEMM == 16
    if (M <= 12) {
        GROUP(M);
        return;
    }
    for (; m0 + 8 <= M; m0 += 8) GROUP(8);
    switch (M - m0) {
        case 1: GROUP(1); break;
        case 2: GROUP(2); break;
        case 3: GROUP(3); break;
        case 4: GROUP(4); break;
        case 5: GROUP(5); break;
        case 6: GROUP(6); break;
        case 7: GROUP(7); break;
    }
#else
    for (; m0 + 4 <= M; m0 += 4) GROUP(4);
    switch (M - m0) {
        case 1: GROUP(1); break;
        case 2: GROUP(2); break;
        case 3: GROUP(3); break;
    }
#endif
}

__attribute__((always_inline)) static inline void rows(int M, int R, int N, int K, float alpha, const float *A,
                                                       int lda, const float *B, int ldb, float beta, float *C,
                                                       int ldc) {
    int n = 0;
    for (; n + R <= N; n += R) groups(M, R, n, K, alpha, A, lda, B, ldb, beta, C, ldc);
    for (; n < N; n++) groups(M, 1, n, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

#define CASE(m, r) \
    case m:        \
        rows(m, r, N, K, alpha, A, lda, B, ldb, beta, C, ldc); \
        return 1;

static int small(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc) {
    switch (M) {  /* weight rows per block: R x M accumulators, R weights and one A row in registers */
#if SMALL_GEMM == 16
        CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(5, 4) CASE(6, 4) CASE(7, 3) CASE(8, 3)
        CASE(9, 2) CASE(10, 2) CASE(11, 2) CASE(12, 2) CASE(13, 3) CASE(14, 3) CASE(15, 3) CASE(16, 3)
        CASE(17, 3) CASE(18, 3) CASE(19, 3) CASE(20, 3) CASE(21, 3) CASE(22, 3) CASE(23, 3) CASE(24, 3)
#else
        CASE(1, 4) CASE(2, 4) CASE(3, 3) CASE(4, 3) CASE(5, 3) CASE(6, 3) CASE(7, 3) CASE(8, 3) CASE(9, 3) CASE(10, 3)
        CASE(11, 3) CASE(12, 3) CASE(13, 3) CASE(14, 3) CASE(15, 3) CASE(16, 3) CASE(17, 3) CASE(18, 3) CASE(19, 3)
        CASE(20, 3) CASE(21, 3) CASE(22, 3) CASE(23, 3) CASE(24, 3)
#endif
    }
    return 0;
}

/* C = alpha * A @ B + beta * C with B stored [K, N] row-major (NoTrans, NoTrans: attention's
   probabilities times its values, P [L, kL] @ V [kL, D]). Each output sums its K products in
   ascending k as one FMA chain, whatever M is, so a verify's rows equal the decode steps of the
   same tokens bit for bit. OpenBLAS's kernels do not: on a 2-core AVX2 EPYC (Zen) its M = 9
   product rounded rows 0-7 differently from M = 1 and row 8 alike (2026-12-07; its SkylakeX
   kernels happened to agree). NN_COLS vectors of outputs per row in registers. */
enum { NN_MAX_N = 512, NN_COLS = 4 };

static inline void nn_put(float *c, vec acc, int w, float alpha, float beta) {
    float out[SMALL_GEMM];
    V_STORE(out, acc);
    for (int l = 0; l < w; l++) c[l] = beta == 0.f ? alpha * out[l] : alpha * out[l] + beta * c[l];
}

/* MR (1 or 2) rows of C, columns [n, n + NN_COLS vectors): MR x NN_COLS independent chains (the
   FMA latency hidden), each B vector loaded once for both rows */
__attribute__((always_inline)) static inline void nn_block(int MR, int n, int K, float alpha, const float *A,
                                                           int lda, const float *B, int ldb, float beta, float *C,
                                                           int ldc) {
    vec acc[2][NN_COLS];
#pragma GCC unroll 2
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NN_COLS; j++) acc[r][j] = V_ZERO();
    for (int k = 0; k < K; k++) {
        const float *b = B + (size_t)k * ldb + n;
        vec w[NN_COLS];
#pragma GCC unroll 4
        for (int j = 0; j < NN_COLS; j++) w[j] = V_LOAD(b + j * SMALL_GEMM);
#pragma GCC unroll 2
        for (int r = 0; r < MR; r++) {
            vec x = V_SET1(A[(size_t)r * lda + k]);
#pragma GCC unroll 4
            for (int j = 0; j < NN_COLS; j++) acc[r][j] = V_FMA(x, w[j], acc[r][j]);
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NN_COLS; j++) nn_put(C + (size_t)r * ldc + n + j * SMALL_GEMM, acc[r][j], SMALL_GEMM, alpha, beta);
}

static int small_nn(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb,
                    float beta, float *C, int ldc) {
    if (N > NN_MAX_N) return 0;
    int NB = N / (NN_COLS * SMALL_GEMM) * (NN_COLS * SMALL_GEMM);
    int m = 0;
    for (; m + 2 <= M; m += 2)
        for (int n = 0; n < NB; n += NN_COLS * SMALL_GEMM)
            nn_block(2, n, K, alpha, A + (size_t)m * lda, lda, B, ldb, beta, C + (size_t)m * ldc, ldc);
    if (m < M)
        for (int n = 0; n < NB; n += NN_COLS * SMALL_GEMM)
            nn_block(1, n, K, alpha, A + (size_t)m * lda, lda, B, ldb, beta, C + (size_t)m * ldc, ldc);
    for (m = 0; m < M && NB < N; m++) { /* the columns past the blocks: a vector at a time, the last masked */
        const float *a = A + (size_t)m * lda;
        for (int n = NB; n < N; n += SMALL_GEMM) {
            int w = N - n < SMALL_GEMM ? N - n : SMALL_GEMM;
            tailmask t = V_TAIL(w);
            vec acc = V_ZERO();
            for (int k = 0; k < K; k++) acc = V_FMA(V_SET1(a[k]), V_LOAD_TAIL(t, B + (size_t)k * ldb + n), acc);
            nn_put(C + (size_t)m * ldc + n, acc, w, alpha, beta);
        }
    }
    return 1;
}

/* Two cores: while OpenBLAS may run more than one thread (the governor saw the cores free), a
   product big enough is split by output columns between the calling thread and one worker of
   ours. Each output is still summed by one thread in the same order, so the result is the same
   bit for bit as on one core. The worker spins a little after each part (the next product of a
   forward comes within microseconds), then sleeps on a condition variable. */
#include <pthread.h>
enum { SPLIT_MACS = 1 << 17, SPIN = 20000 };
static struct {
    int M, N, K, lda, ldb, ldc;
    float alpha, beta;
    const float *A, *B;
    float *C;
} job;
static int job_gen, done_gen, worker_up, busy;
static int split_ok = 1;  /* 0: never split (mlxspec_small_gemm_set_split) */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

void mlxspec_small_gemm_set_split(int on) { split_ok = on; }

static void *worker(void *arg) {
    (void)arg;
    int seen = 0;
    for (;;) {
        int g, spins = 0;
        while ((g = __atomic_load_n(&job_gen, __ATOMIC_ACQUIRE)) == seen) {
            if (++spins < SPIN) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&mu);
            while ((g = __atomic_load_n(&job_gen, __ATOMIC_ACQUIRE)) == seen) pthread_cond_wait(&cv, &mu);
            pthread_mutex_unlock(&mu);
            break;
        }
        seen = g;
        small(job.M, job.N, job.K, job.alpha, job.A, job.lda, job.B, job.ldb, job.beta, job.C, job.ldc);
        __atomic_store_n(&done_gen, g, __ATOMIC_RELEASE);
    }
    return NULL;
}

static void after_fork_child(void) { /* the worker does not exist in a forked child */
    worker_up = 0;
    busy = 0;
    job_gen = done_gen = 0;
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&cv, NULL);
}

static int start_worker(void) {
    static int tried;
    if (worker_up) return 1;
    if (tried) return 0;
    tried = 1;
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, worker, NULL) != 0) return 0;
    pthread_atfork(NULL, NULL, after_fork_child);
    worker_up = 1;
    tried = 0;
    return 1;
}

/* the product on two cores -> 1, or 0 (not worth it, the worker is busy with another caller's
   product, or it cannot start): the caller computes it alone */
static int split(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc) {
    if (!split_ok || N < 8 || (long)M * N * K < SPLIT_MACS) return 0;
    if (__atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE)) return 0;
    if (!start_worker()) {
        __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
        return 0;
    }
    int n0 = (N / 2) & ~3;
    job.M = M, job.N = N - n0, job.K = K, job.alpha = alpha, job.beta = beta;
    job.A = A, job.lda = lda, job.B = B + (size_t)n0 * ldb, job.ldb = ldb, job.C = C + n0, job.ldc = ldc;
    int g = job_gen + 1;
    pthread_mutex_lock(&mu);
    __atomic_store_n(&job_gen, g, __ATOMIC_RELEASE);
    pthread_cond_signal(&cv);
    pthread_mutex_unlock(&mu);
    small(M, n0, K, alpha, A, lda, B, ldb, beta, C, ldc);
    while (__atomic_load_n(&done_gen, __ATOMIC_ACQUIRE) != g) _mm_pause();
    __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
    return 1;
}
#endif

static int threads_looked_up;

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
#ifdef SMALL_GEMM
    if (!blas_threads && !threads_looked_up) {  /* preloaded (LD_PRELOAD) rather than attached: find it */
        blas_threads = (threads_fn)dlsym(RTLD_DEFAULT, "openblas_get_num_threads");
        threads_looked_up = 1;
    }
    if (order == RowMajor && ta == NoTrans && tb == Trans && M >= 1 && M <= max_rows && M <= KERNEL_ROWS && N >= 1 && K >= 1 &&
        lda >= K && ldb >= K && ldc >= N) {
        int threads = blas_threads == NULL ? 1 : blas_threads();
        if ((M <= threaded_rows || threads <= 1) &&
            ((threads > 1 && split(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) ||
             small(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc))) {
            __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    if (order == RowMajor && ta == NoTrans && tb == NoTrans && M >= 1 && M <= max_rows && M <= KERNEL_ROWS &&
        N >= 1 && K >= 1 && lda >= K && ldb >= N && ldc >= N &&
        small_nn(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) {
        __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
        return;
    }
#endif
    if (!next_sgemm) next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    next_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
