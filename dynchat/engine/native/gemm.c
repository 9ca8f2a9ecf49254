/* Matmuls of float32 activations with float32, int8, or GGUF Q4_1 / Q8_0 block weights: the lean
   forward's native, int8 and int4 routes, and the native decoder layer (q41_gemm, q80_gemm below).

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
   weight rows, shared out by spans.c. */
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

/* Weight rows as the tiles read them: LOAD(w, aux, n, k, K) gives weights k.. k+VW-1 of row n as floats;
   FINISH(sum, aux, n) the finished dot product. */
#define F32_LOAD(w, aux, n, k, K) vload((const float *)(w) + (long)(n) * (K) + (k))
#define I8_LOAD(w, aux, n, k, K) vload_i8((const int8_t *)(w) + (long)(n) * (K) + (k))
#define PLAIN_FINISH(sum, aux, n) (sum)
#define SCALED_FINISH(sum, aux, n) ((sum) * ((const float *)(aux))[n])

/* Q4_1 (GGUF's 4-bit blocks of 32: weight = d * q + m, q in 0..15; the 16 bytes of a block hold
   q[j] in the low nibble of byte j and q[j + 16] in its high one), unpacked here as d, m float32 per
   row and block and the nibbles. A weight is rebuilt as d * q, rounded, plus m, rounded (no fused
   multiply-add, as the library is built with -ffp-contract=off: the same two roundings as GGUF's own
   dequantization), so a model whose float32
   weights were dequantized from these blocks gets exactly its float32 weights back, and this route
   multiplies them exactly as the native float32 one does: the same bits from a seventh of the bytes. */
typedef struct { const float *d, *m; } q41_aux;

static inline vec q41_load(const uint8_t *qs, const q41_aux *aux, long n, int k, int K) {
    long block = n * (K / 32) + k / 32;
    int o = k % 32;
    const uint8_t *bytes = qs + block * 16 + o % 16;
#ifdef __AVX512F__
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    if (o >= 16) q = _mm512_srli_epi32(q, 4);
    q = _mm512_and_si512(q, _mm512_set1_epi32(15));
    __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(aux->d[block]));
    return _mm512_add_ps(w, _mm512_set1_ps(aux->m[block]));
#else
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    if (o >= 16) q = _mm256_srli_epi32(q, 4);
    q = _mm256_and_si256(q, _mm256_set1_epi32(15));
    __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(aux->d[block]));
    return _mm256_add_ps(w, _mm256_set1_ps(aux->m[block]));
#endif
}
#define Q41_LOAD(w, aux, n, k, K) q41_load((const uint8_t *)(w), (const q41_aux *)(aux), (n), (k), (K))

/* Q8_0 (GGUF's 8-bit blocks of 32: weight = d * q, q in -128..127): rebuilt with GGUF's one rounding */
static inline vec q80_load(const int8_t *q, const float *d, long n, int k, int K) {
    vec w = vload_i8(q + n * K + k);
#ifdef __AVX512F__
    return _mm512_mul_ps(w, _mm512_set1_ps(d[n * (K / 32) + k / 32]));
#else
    return _mm256_mul_ps(w, _mm256_set1_ps(d[n * (K / 32) + k / 32]));
#endif
}
#define Q80_LOAD(w, aux, n, k, K) q80_load((const int8_t *)(w), (const float *)(aux), (n), (k), (K))

/* One tile of MR activation rows x NR weight rows; prefetches (HINT) BYTES_PER_ROW_STEP of each of
   the next tile's rows a step. */
#define TILE(NAME, LOAD, FINISH, BYTES_PER_ROW_STEP, HINT, MR, NR)                                \
static inline void NAME##_##MR##x##NR(const float *x, const void *w, float *y, int m0, int n0, int N, int K, \
                                      const char *next, const void *aux) {                         \
    const int bytes_per_step = NR * (BYTES_PER_ROW_STEP);                                          \
    vec acc[MR][NR];                                                                               \
    for (int i = 0; i < MR; i++)                                                                   \
        for (int j = 0; j < NR; j++) acc[i][j] = vzero();                                          \
    for (int k = 0, step = 0; k < K; k += VW, step++) {                                            \
        if (next)                                                                                  \
            for (int b = step * bytes_per_step; b < (step + 1) * bytes_per_step; b += 64)           \
                _mm_prefetch(next + b, HINT);                                                      \
        vec wv[NR];                                                                                \
        for (int j = 0; j < NR; j++) wv[j] = LOAD(w, aux, n0 + j, k, K);                           \
        for (int i = 0; i < MR; i++) {                                                             \
            vec xv = vload(x + (long)(m0 + i) * K + k);                                            \
            for (int j = 0; j < NR; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);                   \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < MR; i++)                                                                   \
        for (int j = 0; j < NR; j++)                                                               \
            y[(long)(m0 + i) * N + n0 + j] = FINISH(vsum(acc[i][j]), aux, n0 + j);                 \
}

/* Tile shapes. A step (one activation row) on float32 weights reads one weight row at a time: a single
   sequential stream per thread, where 4 rows read side by side are 4 streams a row apart (SmolLM2's
   float32 matrices, 538 MB, one row: 66-74 against 58-63 GB/s on a 2-core AMD EPYC whose plain read
   makes 76-80). With more activation rows the 4-row tiles, which load each activation vector once for
   4 weight rows, stay faster; so do they for int8 weights, whose conversion to floats a single
   accumulator chain would wait on (one row 1.7x slower so). AVX-512 (32 registers): up to 6 rows x 4
   weight rows. AVX2 (16 registers): up to 3 x 4 for a short verify; from 4 rows on, up to 6 x 2, so a
   verify of 4-6 tokens rebuilds each weight vector once rather than twice (rebuilding int8 or 4-bit
   weights as floats, not streaming them, is what a row costs on AVX2). Every (m, n) is summed alike in
   every shape. */
#ifdef __AVX512F__
#define TILES(NAME, ...) TILE(NAME, __VA_ARGS__, 1, 1) \
                         TILE(NAME, __VA_ARGS__, 1, 4) TILE(NAME, __VA_ARGS__, 2, 4) TILE(NAME, __VA_ARGS__, 3, 4) \
                         TILE(NAME, __VA_ARGS__, 4, 4) TILE(NAME, __VA_ARGS__, 5, 4) TILE(NAME, __VA_ARGS__, 6, 4)
#define DISPATCH(NAME, MR, NR_, ...) if (NR_ == 1) NAME##_1x1(__VA_ARGS__); \
    else switch (MR) { case 1: NAME##_1x4(__VA_ARGS__); break; case 2: NAME##_2x4(__VA_ARGS__); break; \
    case 3: NAME##_3x4(__VA_ARGS__); break; case 4: NAME##_4x4(__VA_ARGS__); break; case 5: NAME##_5x4(__VA_ARGS__); break; \
    default: NAME##_6x4(__VA_ARGS__); }
#define WIDE_FROM 1000      /* never: one shape */
#else
#define TILES(NAME, ...) TILE(NAME, __VA_ARGS__, 1, 1) \
                         TILE(NAME, __VA_ARGS__, 1, 4) TILE(NAME, __VA_ARGS__, 2, 4) TILE(NAME, __VA_ARGS__, 3, 4) \
                         TILE(NAME, __VA_ARGS__, 1, 2) TILE(NAME, __VA_ARGS__, 2, 2) TILE(NAME, __VA_ARGS__, 3, 2) \
                         TILE(NAME, __VA_ARGS__, 4, 2) TILE(NAME, __VA_ARGS__, 5, 2) TILE(NAME, __VA_ARGS__, 6, 2)
#define DISPATCH_X4_X2(NAME, MR, NR_, ...) if (NR_ == 4) switch (MR) { case 1: NAME##_1x4(__VA_ARGS__); break; \
        case 2: NAME##_2x4(__VA_ARGS__); break; default: NAME##_3x4(__VA_ARGS__); } \
    else switch (MR) { case 1: NAME##_1x2(__VA_ARGS__); break; case 2: NAME##_2x2(__VA_ARGS__); break; \
        case 3: NAME##_3x2(__VA_ARGS__); break; case 4: NAME##_4x2(__VA_ARGS__); break; \
        case 5: NAME##_5x2(__VA_ARGS__); break; default: NAME##_6x2(__VA_ARGS__); }
#define DISPATCH(NAME, MR, NR_, ...) if (NR_ == 1) NAME##_1x1(__VA_ARGS__); else DISPATCH_X4_X2(NAME, MR, NR_, __VA_ARGS__)
#define WIDE_FROM 4         /* rows from which the 6 x 2 tiles are used */
#endif

/* y = x w^T over blocks of nr weight rows (ONE_ROW_NR of them for a single activation row; all M rows
   of a block before the next block), then the last N % nr weight rows one by one, in the same order
   per (m, n). ROW_BYTES(K): a weight row's bytes. */
typedef struct { const float *x; const void *w; const void *aux; float *y; int M, N, K, nr, mr_max, blocks; } gemm_job;
void run_shared(long n, void (*fn)(void *, long), void *ctx);     /* spans.c */
#define GEMM(NAME, LOAD, FINISH, ROW_BYTES, HINT, ONE_ROW_NR)                                      \
TILES(NAME##_tile, LOAD, FINISH, (int)((long)ROW_BYTES(VW)), HINT)                                 \
static void NAME##_block(void *job, long block) {       /* all M rows of one block of nr weight rows */ \
    const gemm_job *j = job;                                                                       \
    int b = (int)block, K = j->K;                                                                  \
    const char *next = b + 1 < j->blocks ? (const char *)j->w + (long)(b + 1) * j->nr * ROW_BYTES(K) : 0; \
    for (int m0 = 0; m0 < j->M; m0 += j->mr_max) {                                                 \
        int mr = j->M - m0 < j->mr_max ? j->M - m0 : j->mr_max;                                    \
        DISPATCH(NAME##_tile, mr, j->nr, j->x, j->w, j->y, m0, b * j->nr, j->N, K, m0 ? 0 : next, j->aux) \
    }                                                                                              \
}                                                                                                  \
static void NAME##_run(const float *x, const void *w, const void *aux, float *y, int M, int N, int K) { \
    const int wide = M >= WIDE_FROM, nr = M == 1 ? ONE_ROW_NR : wide ? 2 : NR, mr_max = wide ? 6 : MR_MAX; \
    int blocks = N / nr;                                                                           \
    gemm_job job = {x, w, aux, y, M, N, K, nr, mr_max, blocks};                                    \
    run_shared(blocks, NAME##_block, &job);                                                        \
    for (int n = blocks * nr; n < N; n++)                                                          \
        for (int m = 0; m < M; m++) {                                                              \
            vec acc = vzero();                                                                     \
            for (int k = 0; k < K; k += VW) acc = vfma(vload(x + (long)m * K + k), LOAD(w, aux, n, k, K), acc); \
            y[(long)m * N + n] = FINISH(vsum(acc), aux, n);                                        \
        }                                                                                          \
}

#define F32_BYTES(K) ((K) * 4)
#define I8_BYTES(K) (K)
/* The next tile is prefetched into L1 on every route: float32 weights prefetched into L2 only made
   SmolLM2's float32 matrices 7-11% slower for 1 to 9 rows (AMD EPYC, one process, the two builds
   alternating; an earlier kernel had lost a verify's activation rows from L1 to them); int8 and block
   weights into L2 ran slower too. */
GEMM(f32, F32_LOAD, PLAIN_FINISH, F32_BYTES, _MM_HINT_T0, 1)
GEMM(i8, I8_LOAD, SCALED_FINISH, I8_BYTES, _MM_HINT_T0, NR)
#ifdef __AVX512F__
GEMM(q80, Q80_LOAD, PLAIN_FINISH, I8_BYTES, _MM_HINT_T0, NR)      /* AVX2: the block tiles below */
#endif

void f32_gemm(const float *x, const float *w, float *y, int M, int N, int K) { f32_run(x, w, 0, y, M, N, K); }

void int8_gemm(const float *x, const int8_t *w, const float *scale, float *y, int M, int N, int K) {
    i8_run(x, w, scale, y, M, N, K);
}

/* The block tiles prefetch the weights (and scales) of the tile this many ahead: on a 2-core EPYC, in one
   process against the next tile, SmolLM2's Q4_1 weights in float32 arithmetic decoded 8% faster; 8
   ahead measured as 4. */
#define BLOCK_AHEAD 4

/* K % 32 == 0; d and m: (N, K / 32) float32, qs: (N, K / 2) bytes. The tiles below go block by block
   (32 weights of each weight row), so a block's d and m are read once, not once per vector, and the
   next tile's d and m are prefetched with its nibbles: three streams, where the generic tile left two
   of them to the hardware's prefetcher and waited on them. */
static inline void prefetch_scales(const float *d, const float *m, long n0, int rows, int blocks) {
    const char *pd = (const char *)(d + n0 * blocks), *pm = m ? (const char *)(m + n0 * blocks) : 0;
    for (long o = 0; o < (long)rows * blocks * 4; o += 64) {
        _mm_prefetch(pd + o, _MM_HINT_T0);
        if (m) _mm_prefetch(pm + o, _MM_HINT_T0);
    }
}

#ifdef __AVX512F__
/* With AVX-512 a block's 16 possible weights d * i + m (i = 0..15, the same two roundings) are built
   once, and each of its 32 weights is one permute of them by its nibble: a third of the
   instructions of converting every weight, the same floats, the same order of multiply-adds. */
#define Q41_MR 5            /* 5 x 4 accumulators, 8 weight vectors and 2 of x in 32 registers */
#define Q41_TILE(MR, NR_)                                                                          \
static inline void q41b_##MR##x##NR_(const float *x, const uint8_t *qs, const float *d, const float *m, \
                                     float *y, int m0, int n0, int N, int K, const char *next) {    \
    const int blocks = K / 32;                                                                     \
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);      \
    __m512 acc[MR][NR_];                                                                           \
    for (int i = 0; i < MR; i++)                                                                   \
        for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_setzero_ps();                             \
    if (next) prefetch_scales(d, m, n0 + BLOCK_AHEAD * NR_, NR_, blocks);                                        \
    for (int b = 0; b < blocks; b++) {                                                             \
        if (next) _mm_prefetch(next + (long)b * NR_ * 16, _MM_HINT_T0);                            \
        __m512 lo[NR_], hi[NR_];                                                                   \
        for (int j = 0; j < NR_; j++) {                                                            \
            long blk = (long)(n0 + j) * blocks + b;                                                \
            __m512 lut = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d[blk])), _mm512_set1_ps(m[blk])); \
            __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + blk * 16)));   \
            lo[j] = _mm512_permutexvar_ps(q, lut);              /* the low 4 bits of each index */   \
            hi[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);                             \
        }                                                                                          \
        for (int i = 0; i < MR; i++) {                                                             \
            __m512 xl = _mm512_loadu_ps(x + (long)(m0 + i) * K + b * 32);                          \
            __m512 xh = _mm512_loadu_ps(x + (long)(m0 + i) * K + b * 32 + 16);                     \
            for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_fmadd_ps(xl, lo[j], acc[i][j]);       \
            for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_fmadd_ps(xh, hi[j], acc[i][j]);       \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < MR; i++)                                                                   \
        for (int j = 0; j < NR_; j++) y[(long)(m0 + i) * N + n0 + j] = vsum(acc[i][j]);            \
}
Q41_TILE(1, 4) Q41_TILE(2, 4) Q41_TILE(3, 4) Q41_TILE(4, 4) Q41_TILE(5, 4)
#define BLOCK_DISPATCH(NAME, MR, NR_, ...) switch (MR) { case 1: NAME##_1x4(__VA_ARGS__); break; \
    case 2: NAME##_2x4(__VA_ARGS__); break; case 3: NAME##_3x4(__VA_ARGS__); break; \
    case 4: NAME##_4x4(__VA_ARGS__); break; default: NAME##_5x4(__VA_ARGS__); }
#define BLOCK_WIDE_FROM 1000  /* never: one shape */
#else
/* AVX2: 8 weights at a time in the order of k, as the generic tile, but one weight row's block at a
   time (its scale read once, few registers); up to 3 x 4 tiles, and 6 x 2 from 4 rows on (a verify of
   4-6 tokens rebuilds each weight once). WEIGHTS(block, s, dv, m, blk): weights 8s .. 8s + 7. */
#define Q41_MR 3
#define BLOCK_TILE(NAME, BLOCK_BYTES, WEIGHTS, MR, NR_)                                            \
static inline void NAME##_##MR##x##NR_(const float *x, const uint8_t *qs, const float *d, const float *m, \
                                       float *y, int m0, int n0, int N, int K, const char *next) {  \
    const int blocks = K / 32;                                                                     \
    __m256 acc[MR][NR_];                                                                           \
    for (int i = 0; i < MR; i++)                                                                   \
        for (int j = 0; j < NR_; j++) acc[i][j] = _mm256_setzero_ps();                             \
    if (next) prefetch_scales(d, m, n0 + BLOCK_AHEAD * NR_, NR_, blocks);                                        \
    for (int b = 0; b < blocks; b++) {                                                             \
        if (next)                                                                                  \
            for (int o = 0; o < NR_ * (BLOCK_BYTES); o += 64)                                      \
                _mm_prefetch(next + (long)b * NR_ * (BLOCK_BYTES) + o, _MM_HINT_T0);               \
        for (int j = 0; j < NR_; j++) {                                                            \
            long blk = (long)(n0 + j) * blocks + b;                                                \
            __m256 dv = _mm256_set1_ps(d[blk]);                                                    \
            for (int s = 0; s < 4; s++) {                                                          \
                __m256 w = WEIGHTS(qs + blk * (BLOCK_BYTES), s, dv, m, blk);                        \
                for (int i = 0; i < MR; i++)                                                       \
                    acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (long)(m0 + i) * K + b * 32 + 8 * s), w, acc[i][j]); \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < MR; i++)                                                                   \
        for (int j = 0; j < NR_; j++) y[(long)(m0 + i) * N + n0 + j] = vsum(acc[i][j]);            \
}
#define BLOCK_TILES(NAME, BLOCK_BYTES, WEIGHTS)                                                    \
    BLOCK_TILE(NAME, BLOCK_BYTES, WEIGHTS, 1, 4) BLOCK_TILE(NAME, BLOCK_BYTES, WEIGHTS, 2, 4)       \
    BLOCK_TILE(NAME, BLOCK_BYTES, WEIGHTS, 3, 4) BLOCK_TILE(NAME, BLOCK_BYTES, WEIGHTS, 1, 2)       \
    BLOCK_TILE(NAME, BLOCK_BYTES, WEIGHTS, 2, 2) BLOCK_TILE(NAME, BLOCK_BYTES, WEIGHTS, 3, 2)       \
    BLOCK_TILE(NAME, BLOCK_BYTES, WEIGHTS, 4, 2) BLOCK_TILE(NAME, BLOCK_BYTES, WEIGHTS, 5, 2)       \
    BLOCK_TILE(NAME, BLOCK_BYTES, WEIGHTS, 6, 2)

/* Q4_1: q from the low nibbles of the block's 16 bytes (s = 0, 1), then the high ones (s = 2, 3);
   d * q, rounded, plus m, rounded, as GGUF dequantizes */
static inline __m256 q41_weights8(const uint8_t *block, int s, __m256 dv, const float *m, long blk) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 8 * (s & 1))));
    q = s < 2 ? _mm256_and_si256(q, _mm256_set1_epi32(15)) : _mm256_srli_epi32(q, 4);
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), dv), _mm256_set1_ps(m[blk]));
}
/* Q8_0: d * q, GGUF's one rounding */
static inline __m256 q80_weights8(const uint8_t *block, int s, __m256 dv, const float *m, long blk) {
    (void)m, (void)blk;
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 8 * s)))), dv);
}
BLOCK_TILES(q41b, 16, q41_weights8)
BLOCK_TILES(q80b, 32, q80_weights8)
#define BLOCK_DISPATCH DISPATCH_X4_X2      /* the block tiles keep their 4-row tiles for one row too */
#define BLOCK_WIDE_FROM WIDE_FROM
#endif

/* y = x w^T for GGUF block weights on the block tiles (NAME##_MRxNR), as GEMM does for the others */
typedef struct { const float *x; const uint8_t *qs; const float *d, *m; float *y; int M, N, K, nr, mr_max, tiles; } block_job;
#define BLOCK_TILE_RUN(NAME, BLOCK_BYTES)                                                          \
static void NAME##_tile_rows(void *job, long tile) {   /* all M rows of one tile of nr weight rows */ \
    const block_job *j = job;                                                                      \
    int t = (int)tile, nr = j->nr, K = j->K;                                                       \
    const char *next = t + BLOCK_AHEAD < j->tiles ? (const char *)j->qs + (long)(t + BLOCK_AHEAD) * nr * (K / 32) * (BLOCK_BYTES) : 0; \
    for (int m0 = 0; m0 < j->M; m0 += j->mr_max) {                                                 \
        int mr = j->M - m0 < j->mr_max ? j->M - m0 : j->mr_max;                                    \
        BLOCK_DISPATCH(NAME, mr, nr, j->x, j->qs, j->d, j->m, j->y, m0, t * nr, j->N, K, m0 ? 0 : next) \
    }                                                                                              \
}
BLOCK_TILE_RUN(q41b, 16)
#ifndef __AVX512F__
BLOCK_TILE_RUN(q80b, 32)
#endif
#define BLOCK_RUN(NAME, BLOCK_BYTES, WIDE_AT, MR_MAX_)                                             \
    const int wide = M >= WIDE_AT, nr = wide ? 2 : NR, mr_max = wide ? 6 : MR_MAX_;                \
    int tiles = N / nr;                                                                            \
    block_job job = {x, qs, d, m, y, M, N, K, nr, mr_max, tiles};                                 \
    run_shared(tiles, NAME##_tile_rows, &job);

void q41_gemm(const float *x, const uint8_t *qs, const float *d, const float *m, float *y, int M, int N, int K) {
    q41_aux aux = {d, m};
    BLOCK_RUN(q41b, 16, BLOCK_WIDE_FROM, Q41_MR)
    for (int n = tiles * nr; n < N; n++)        /* the last N % nr rows as the generic path does them */
        for (int r = 0; r < M; r++) {
            vec acc = vzero();
            for (int k = 0; k < K; k += VW) acc = vfma(vload(x + (long)r * K + k), Q41_LOAD(qs, &aux, n, k, K), acc);
            y[(long)r * N + n] = vsum(acc);
        }
}

/* K % 32 == 0; d: (N, K / 32) float32, q: (N, K) int8 */
void q80_gemm(const float *x, const int8_t *q, const float *d, float *y, int M, int N, int K) {
#ifdef __AVX512F__
    q80_run(x, q, d, y, M, N, K);
#else
    const uint8_t *qs = (const uint8_t *)q;
    const float *m = 0;
    BLOCK_RUN(q80b, 32, WIDE_FROM, MR_MAX)
    for (int n = tiles * nr; n < N; n++)
        for (int r = 0; r < M; r++) {
            vec acc = vzero();
            for (int k = 0; k < K; k += VW) acc = vfma(vload(x + (long)r * K + k), Q80_LOAD(q, d, n, k, K), acc);
            y[(long)r * N + n] = vsum(acc);
        }
#endif
}
