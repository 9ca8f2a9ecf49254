/* Matmuls of float32 activations with float32 or int8 weights: the lean forward's native and int8
   routes, and the native decoder layer.

   f32_gemm:  y[m][n] = sum_k x[m][k] * w[n][k]             x (M, K) float32, w (N, K) float32
   int8_gemm: y[m][n] = scale[n] * sum_k x[m][k] * w[n][k]  w int8 (per output row scale)
   K % 16 == 0 for both.

   Why: a k-token verify should cost little more than one token, as every weight is read from
   memory once either way. A tile of up to MR activation rows x 4 weight rows keeps MR x 4
   accumulators in registers, so each weight load (int8: converted to float32 in registers) feeds
   MR multiply-adds and each activation load four; the next tile's weights are prefetched while
   this one computes. Built for the machine it runs on: 16-wide AVX-512 with tiles of up to 6 rows
   where the CPU has it, else 8-wide AVX2 with tiles of up to 3. (PyTorch's int8 kernel,
   _weight_int8pack_mm, takes bfloat16 activations and streams int8 weights at about half the
   memory's speed on CPUs without AVX-512.)

   Every (m, n) is summed in the same order (one accumulator over k in steps of the vector width,
   then its lanes), whatever M is and whichever tile it falls in: a row's result does not depend
   on the other rows, so verifying k tokens in one call gives exactly what k single-token steps
   give. Threads: the caller's OpenMP runtime (PyTorch's libgomp, loaded first), over blocks of 4
   weight rows. */
#include <immintrin.h>
#include <stdint.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define VW 16
#define MR_MAX 6
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vfma _mm512_fmadd_ps
#define vload_i8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
static inline float vsum(__m512 s) { return _mm512_reduce_add_ps(s); }
#else
typedef __m256 vec;
#define VW 8
#define MR_MAX 3
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
#define vload_i8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
static inline float vsum(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif
#define NR 4

/* One tile for weights of type T loaded by LOAD; prefetches BYTES_PER_STEP of the next tile a step. */
#define TILE(NAME, T, LOAD, MR)                                                                    \
static inline void NAME##_##MR(const float *x, const T *w, float *y, int m0, int n0, int N, int K,   \
                               const char *next, const float *scale) {                             \
    const int bytes_per_step = NR * VW * (int)sizeof(T);                                           \
    vec acc[MR][NR];                                                                               \
    for (int i = 0; i < MR; i++)                                                                   \
        for (int j = 0; j < NR; j++) acc[i][j] = vzero();                                          \
    for (int k = 0, step = 0; k < K; k += VW, step++) {                                            \
        if (next)                                                                                  \
            for (int b = step * bytes_per_step; b < (step + 1) * bytes_per_step; b += 64)           \
                _mm_prefetch(next + b, _MM_HINT_T0);                                               \
        vec wv[NR];                                                                                \
        for (int j = 0; j < NR; j++) wv[j] = LOAD(w + (long)(n0 + j) * K + k);                     \
        for (int i = 0; i < MR; i++) {                                                             \
            vec xv = vload(x + (long)(m0 + i) * K + k);                                            \
            for (int j = 0; j < NR; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);                   \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < MR; i++)                                                                   \
        for (int j = 0; j < NR; j++)                                                               \
            y[(long)(m0 + i) * N + n0 + j] = scale ? vsum(acc[i][j]) * scale[n0 + j] : vsum(acc[i][j]); \
}

#if MR_MAX > 3
#define TILES(NAME, T, LOAD) TILE(NAME, T, LOAD, 1) TILE(NAME, T, LOAD, 2) TILE(NAME, T, LOAD, 3) \
                             TILE(NAME, T, LOAD, 4) TILE(NAME, T, LOAD, 5) TILE(NAME, T, LOAD, 6)
#define DISPATCH(NAME, MR, ...) switch (MR) { case 1: NAME##_1(__VA_ARGS__); break; case 2: NAME##_2(__VA_ARGS__); break; \
    case 3: NAME##_3(__VA_ARGS__); break; case 4: NAME##_4(__VA_ARGS__); break; case 5: NAME##_5(__VA_ARGS__); break; \
    default: NAME##_6(__VA_ARGS__); }
#else
#define TILES(NAME, T, LOAD) TILE(NAME, T, LOAD, 1) TILE(NAME, T, LOAD, 2) TILE(NAME, T, LOAD, 3)
#define DISPATCH(NAME, MR, ...) switch (MR) { case 1: NAME##_1(__VA_ARGS__); break; case 2: NAME##_2(__VA_ARGS__); break; \
    default: NAME##_3(__VA_ARGS__); }
#endif

/* y = x w^T over blocks of 4 weight rows (all M rows of a block before the next block), then the
   last N % 4 weight rows one by one, in the same order per (m, n). */
#define GEMM(NAME, T, LOAD)                                                                        \
TILES(NAME##_tile, T, LOAD)                                                                        \
static void NAME##_run(const float *x, const T *w, const float *scale, float *y, int M, int N, int K) { \
    int blocks = N / NR;                                                                           \
    _Pragma("omp parallel for schedule(static)")                                                   \
    for (int b = 0; b < blocks; b++) {                                                             \
        const char *next = b + 1 < blocks ? (const char *)(w + (long)(b + 1) * NR * K) : 0;       \
        for (int m0 = 0; m0 < M; m0 += MR_MAX) {                                                   \
            int mr = M - m0 < MR_MAX ? M - m0 : MR_MAX;                                            \
            DISPATCH(NAME##_tile, mr, x, w, y, m0, b * NR, N, K, m0 ? 0 : next, scale)             \
        }                                                                                          \
    }                                                                                              \
    for (int n = blocks * NR; n < N; n++)                                                          \
        for (int m = 0; m < M; m++) {                                                              \
            vec acc = vzero();                                                                     \
            for (int k = 0; k < K; k += VW) acc = vfma(vload(x + (long)m * K + k), LOAD(w + (long)n * K + k), acc); \
            y[(long)m * N + n] = scale ? vsum(acc) * scale[n] : vsum(acc);                         \
        }                                                                                          \
}

GEMM(f32, float, vload)
GEMM(i8, int8_t, vload_i8)

void f32_gemm(const float *x, const float *w, float *y, int M, int N, int K) { f32_run(x, w, 0, y, M, N, K); }

void int8_gemm(const float *x, const int8_t *w, const float *scale, float *y, int M, int N, int K) {
    i8_run(x, w, scale, y, M, N, K);
}
