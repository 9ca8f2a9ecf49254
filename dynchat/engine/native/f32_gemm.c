/* float32 weight x float32 activation matmul for the lean forward's native route (and the native
   decoder layer): y[m][n] = sum_k x[m][k] * w[n][k];  x (M, K), w (N, K), K % 16 == 0.

   Why: a k-token verify should cost little more than one token, as every weight is read from
   memory once either way. Here a tile of up to MR activation rows x 4 weight rows keeps MR x 4
   accumulators in registers, so each weight load feeds MR multiply-adds and each activation load
   four; the next tile's weights are prefetched while this one computes. Built for the machine it
   runs on: 16-wide AVX-512 with tiles of up to 6 rows where the CPU has it, else 8-wide AVX2 with
   tiles of up to 3 rows.

   Every (m, n) is summed in the same order (one accumulator over k in steps of the vector width,
   then its lanes), whatever M is and whichever tile it falls in: a row's result does not depend
   on the other rows, so verifying k tokens in one call gives exactly what k single-token steps
   give. Threads: the caller's OpenMP runtime, over blocks of 4 weight rows. */
#include <immintrin.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define VW 16
#define MR_MAX 6
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vfma _mm512_fmadd_ps
static inline float vsum(__m512 s) { return _mm512_reduce_add_ps(s); }
#else
typedef __m256 vec;
#define VW 8
#define MR_MAX 3
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
static inline float vsum(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif
#define NR 4
#define LINES_PER_STEP (NR * VW * 4 / 64)     /* the next tile's weights, spread over this tile's steps */

#define TILE(MR)                                                                                   \
static inline void tile_##MR(const float *x, const float *w, float *y, int m0, int n0, int N, int K, \
                             const char *next) {                                                   \
    vec acc[MR][NR];                                                                               \
    for (int i = 0; i < MR; i++)                                                                   \
        for (int j = 0; j < NR; j++) acc[i][j] = vzero();                                          \
    for (int k = 0, step = 0; k < K; k += VW, step++) {                                            \
        if (next)                                                                                  \
            for (int l = 0; l < LINES_PER_STEP; l++)                                               \
                _mm_prefetch(next + (step * LINES_PER_STEP + l) * 64, _MM_HINT_T0);                \
        vec wv[NR];                                                                                \
        for (int j = 0; j < NR; j++) wv[j] = vload(w + (long)(n0 + j) * K + k);                    \
        for (int i = 0; i < MR; i++) {                                                             \
            vec xv = vload(x + (long)(m0 + i) * K + k);                                            \
            for (int j = 0; j < NR; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);                   \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < MR; i++)                                                                   \
        for (int j = 0; j < NR; j++) y[(long)(m0 + i) * N + n0 + j] = vsum(acc[i][j]);             \
}
TILE(1) TILE(2) TILE(3)
#if MR_MAX > 3
TILE(4) TILE(5) TILE(6)
#endif

static void rows_x_block(const float *x, const float *w, float *y, int M, int n0, int N, int K, const char *next) {
    for (int m0 = 0; m0 < M; m0 += MR_MAX) {
        int mr = M - m0 < MR_MAX ? M - m0 : MR_MAX;
        const char *pf = m0 ? 0 : next;       /* the first pass over the block prefetches the next */
        switch (mr) {
            case 1: tile_1(x, w, y, m0, n0, N, K, pf); break;
            case 2: tile_2(x, w, y, m0, n0, N, K, pf); break;
#if MR_MAX > 3
            case 3: tile_3(x, w, y, m0, n0, N, K, pf); break;
            case 4: tile_4(x, w, y, m0, n0, N, K, pf); break;
            case 5: tile_5(x, w, y, m0, n0, N, K, pf); break;
            default: tile_6(x, w, y, m0, n0, N, K, pf); break;
#else
            default: tile_3(x, w, y, m0, n0, N, K, pf); break;
#endif
        }
    }
}

void f32_gemm(const float *x, const float *w, float *y, int M, int N, int K) {
    int blocks = N / NR;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++)
        rows_x_block(x, w, y, M, b * NR, N, K, b + 1 < blocks ? (const char *)(w + (long)(b + 1) * NR * K) : 0);
    for (int n = blocks * NR; n < N; n++)       /* the last N % 4 weight rows: same order per (m, n) */
        for (int m = 0; m < M; m++) {
            vec acc = vzero();
            for (int k = 0; k < K; k += VW) acc = vfma(vload(x + (long)m * K + k), vload(w + (long)n * K + k), acc);
            y[(long)m * N + n] = vsum(acc);
        }
}
