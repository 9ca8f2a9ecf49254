/* GGUF Q4_1 weights times activations rounded to int8 per block of 32, in integer dot products:
   what llama.cpp does for its 4-bit weights (Q8_1 activations), laid out for a verify.

   Why: multiplying the 4-bit weights in float32 (gemm.c q41_gemm) rebuilds every weight as a float
   and spends one float multiply-add per weight and row: on a 2-core CPU a verified row then costs
   ~30% of a step, and speculation cannot pay. An integer dot product (VNNI vpdpbusd: 64 byte
   products a instruction; AVX2 without VNNI: vpmaddubsw + vpmaddwd) does four weights a lane,
   and the weights are unpacked once for all the rows of a verify.

   Layout (q41x16_pack in linear.py): weight rows in groups of 16; per group and block of 32, 256
   bytes: chunk c (0..3) holds, for each of the 16 rows, 4 bytes whose low nibbles are q[4c .. 4c+3]
   and high nibbles q[16+4c .. 16+4c+3], so one 64-byte load gives 16 rows x 4 weights twice; then
   the 16 rows' d and m as float16 (GGUF's own, converted exactly): 320 bytes, one stream. y[r][n] = sum over blocks of
   d * dx[r] * sum(q * xq[r]) + m * sx[r], with xq = round(x / dx), dx = max|x| / 127 and
   sx = dx * sum(xq) per row and block (llama.cpp's Q8_1).

   Rows stay independent (a row's activations are quantized from that row alone, integer sums are
   exact, and each (row, output) is finished in the same order), so a k-token verify gives exactly
   what k single steps give; the AVX-512 and AVX2 builds give the same bits. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define QB 32

/* x (M, K) -> xq (M, K) int8, dx and sx (M, K / 32); 8-wide on every build, so every build rounds alike */
static void quantize_q8(const float *x, long rows_blocks, int8_t *xq, float *dx, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long i = 0; i < rows_blocks; i++) {
        const float *v = x + i * QB;
        __m256 a[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_loadu_ps(v + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, a[j]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h), d = amax / 127.0f;
        __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4], total = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], id));      /* round to nearest, ties even */
            total = _mm256_add_epi32(total, q[j]);
        }
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + i * QB), p);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        dx[i] = d;
        sx[i] = d * (float)_mm_cvtsi128_si32(t);
    }
}

#define GB_BYTES 320     /* a group's block: 256 bytes of nibbles, 16 d and 16 m as float16 */
/* How far ahead (in a group's blocks) the weights are prefetched. Measured on a 2-core EPYC, in one
   process against 4 blocks: SmolLM2's 30 Q4_1 layers 4-10% faster (1 to 5 rows), its Q8_0 output head
   17-28%; 12-24 blocks measured alike, 2 and 48-64 slower (on a 2-core Xeon 4-32 measure alike).
   Into every cache level, not non-temporal: where the last-level cache holds the whole model (a Xeon's
   300 MB holds SmolLM2's 97 MB) the next step reads it from there, at twice the memory's speed, and a
   non-temporal line never gets there; on that Xeon a step took 6.7 ms so and 2.2 ms into every level.
   On the EPYC (32 MB: the model streams from memory either way) non-temporal had been ~3% faster. */
#define PREFETCH_BLOCKS 16
#define WEIGHT_HINT _MM_HINT_T0

/* the group block PREFETCH_BLOCKS on from p (bytes long) into every cache level */
static inline void prefetch_ahead(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + PREFETCH_BLOCKS * bytes + o, WEIGHT_HINT);
}
/* rows per tile. AVX-512: 8 weight vectors, 8 accumulators, scales: within 32 registers. AVX2 (16
   registers): 5 rows' sums and accumulators beside a chunk's weights (6 or 8 rows spill again). The
   Q8_0 tiles share it: on the output head 5 and 8 rows a tile measured alike for 8-17 rows. */
#ifdef __AVX512F__
#define RT 8
#else
#define RT 5
#endif

#ifdef __AVX512F__
/* The 32-bit sums of one block: for each weight row of the vector, sum over the block's 32 weights of
   q * xq, xr the block's 32 int8 of x as 8 ints of 4 bytes (lo: weights 4c .. 4c+3, hi: 16+4c ..) */
#ifdef __AVX512VNNI__
static inline __m512i block_dot(const __m512i *lo, const __m512i *hi, const int32_t *xr) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        a0 = _mm512_dpbusd_epi32(a0, lo[c], _mm512_set1_epi32(xr[c]));
        a1 = _mm512_dpbusd_epi32(a1, hi[c], _mm512_set1_epi32(xr[4 + c]));
    }
    return _mm512_add_epi32(a0, a1);
}
#else
/* a pair of 4-bit weights times int8 is at most 2 * 15 * 128 = 3840 in magnitude, so a block's 8 pairs
   per lane add up in 16 bits (30720 < 32768) and widen once: the same integers, 2 instructions less a pair */
static inline __m512i block_dot(const __m512i *lo, const __m512i *hi, const int32_t *xr) {
    __m512i s0 = _mm512_maddubs_epi16(lo[0], _mm512_set1_epi32(xr[0]));
    __m512i s1 = _mm512_maddubs_epi16(hi[0], _mm512_set1_epi32(xr[4]));
    for (int c = 1; c < 4; c++) {
        s0 = _mm512_add_epi16(s0, _mm512_maddubs_epi16(lo[c], _mm512_set1_epi32(xr[c])));
        s1 = _mm512_add_epi16(s1, _mm512_maddubs_epi16(hi[c], _mm512_set1_epi32(xr[4 + c])));
    }
    return _mm512_madd_epi16(_mm512_add_epi16(s0, s1), _mm512_set1_epi16(1));
}
#endif
/* one group of 16 weight rows, rows r0 .. r0 + MR - 1 of x */
#define GROUP_TILE(MR)                                                                             \
static void group_##MR(const uint8_t *qs, const int8_t *xq,                                        \
                       const float *dx, const float *sx, float *y, int r0, int g, int N, int K) {   \
    const int blocks = K / QB;                                                                     \
    const __m512i low = _mm512_set1_epi8(15);                                                      \
    __m512 out[MR];                                                                                \
    for (int r = 0; r < MR; r++) out[r] = _mm512_setzero_ps();                                     \
    for (int b = 0; b < blocks; b++) {                                                             \
        long gb = (long)g * blocks + b;                                                            \
        const uint8_t *p = qs + gb * GB_BYTES;                                                     \
        prefetch_ahead(p, GB_BYTES); \
        __m512i lo[4], hi[4];                                                                      \
        for (int c = 0; c < 4; c++) {                                                              \
            __m512i v = _mm512_loadu_si512(p + 64 * c);                                            \
            lo[c] = _mm512_and_si512(v, low);                                                      \
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);                                \
        }                                                                                          \
        __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));               \
        __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));               \
        for (int r = 0; r < MR; r++) {                                                             \
            const int32_t *xr = (const int32_t *)(xq + (long)(r0 + r) * K + b * QB);               \
            long rb = (long)(r0 + r) * blocks + b;                                                 \
            __m512 f = _mm512_cvtepi32_ps(block_dot(lo, hi, xr));                                  \
            out[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(dv, _mm512_set1_ps(dx[rb])), out[r]);       \
            out[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[rb]), out[r]);                          \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(y + (long)(r0 + r) * N + g * 16, out[r]);        \
}
#else
/* One chunk's products added to a row's block sums s (zero at the block's start): weights 4c .. 4c+3 and
   16+4c .. 16+4c+3 of the block (lo, hi) times the row's int8 x there; finish_sums gives the 32-bit
   sums. With VNNI the sums are 32-bit from the start; without, they stay 16-bit within a block (a
   pair of 4-bit weights times int8 is at most 2 * 15 * 128 = 3840 in magnitude, a block's 8 pairs per
   lane at most 30720 < 32768) and widen once: the same integers either way. */
#ifdef __AVXVNNI__
static inline __m256i chunk_dot(__m256i s, __m256i lo, __m256i hi, int32_t xlo, int32_t xhi) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s, lo, _mm256_set1_epi32(xlo)), hi, _mm256_set1_epi32(xhi));
}
static inline __m256i finish_sums(__m256i s) { return s; }
#else
static inline __m256i chunk_dot(__m256i s, __m256i lo, __m256i hi, int32_t xlo, int32_t xhi) {
    return _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xlo)),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xhi))));
}
static inline __m256i finish_sums(__m256i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }
#endif
/* the same sums as the AVX-512 build, 8 weight rows (half a group) at a time, chunk by chunk: one
   chunk's weights live at a time and each row's products added to its block sums at once. Unpacking a
   block's 8 weight vectors first and then going row by row (as before 7 December 2026) left GCC 12 to
   spill 32 vectors a half-block in the 5-row tile (weights, scales, accumulators: ~200 instructions);
   this order spills none (~183). The empty asm statements give each chunk an opaque weight pointer and
   each row's sums a fixed point, so GCC does not gather the chunks' loads and products together (without
   them it did, and spilled more); that holds for GCC 12's output, not by the language. A verify's rows
   are bound by arithmetic on these CPUs: with the weights in L2, 5 rows took nearly as long as with
   them streamed from memory. In one process, old and new tiles alternating, SmolLM2's int4 forward
   of 5 tokens took 6-15% less on a 2-core EPYC, one token the same. */
#define GROUP_TILE(MR)                                                                             \
static void group_##MR(const uint8_t *qs, const int8_t *xq,                                        \
                       const float *dx, const float *sx, float *y, int r0, int g, int N, int K) {   \
    const int blocks = K / QB;                                                                     \
    const __m256i low = _mm256_set1_epi8(15);                                                      \
    for (int half = 0; half < 2; half++) {                                                         \
        __m256 out[MR];                                                                            \
        for (int r = 0; r < MR; r++) out[r] = _mm256_setzero_ps();                                 \
        for (int b = 0; b < blocks; b++) {                                                         \
            long gb = (long)g * blocks + b;                                                        \
            const uint8_t *p = qs + gb * GB_BYTES + 32 * half;                                     \
            if (!half)          /* the second half finds the group's blocks in cache */              \
                prefetch_ahead(p, GB_BYTES);                                                       \
            __m256i s[MR];                  /* each row's block sums */                           \
            for (int r = 0; r < MR; r++) s[r] = _mm256_setzero_si256();                            \
            for (int c = 0; c < 4; c++) {                                                          \
                __asm__("" : "+r"(p));      /* an opaque pointer: loads stay per chunk */          \
                __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * c));                     \
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low); \
                for (int r = 0; r < MR; r++) {                                                     \
                    const int32_t *xr = (const int32_t *)(xq + (long)(r0 + r) * K + b * QB);       \
                    s[r] = chunk_dot(s[r], lo, hi, xr[c], xr[4 + c]);                          \
                    __asm__("" : "+x"(s[r]));                                                      \
                }                                                                                  \
            }                                                                                      \
            __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256 - 16 * half))); \
            __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 288 - 16 * half))); \
            for (int r = 0; r < MR; r++) {                                                         \
                long rb = (long)(r0 + r) * blocks + b;                                             \
                __m256 f = _mm256_cvtepi32_ps(finish_sums(s[r]));                                   \
                out[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(dv, _mm256_set1_ps(dx[rb])), out[r]);   \
                out[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx[rb]), out[r]);                      \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < MR; r++) _mm256_storeu_ps(y + (long)(r0 + r) * N + g * 16 + 8 * half, out[r]); \
    }                                                                                              \
}
#endif
GROUP_TILE(1) GROUP_TILE(2) GROUP_TILE(3) GROUP_TILE(4) GROUP_TILE(5) GROUP_TILE(6) GROUP_TILE(7) GROUP_TILE(8)

/* A group tile: rows r0 .. r0 + MR - 1 of x against one group of 16 weight rows */
typedef void (*group_tile)(const uint8_t *, const int8_t *, const float *, const float *, float *, int, int, int, int);
static const group_tile Q41_TILES[8] = {group_1, group_2, group_3, group_4, group_5, group_6, group_7, group_8};

void run_shared(long n, void (*fn)(void *, long), void *ctx);     /* spans.c */
typedef struct { const group_tile *tiles; const uint8_t *qs; const int8_t *xq; const float *dx, *sx; float *y; int M, N, K; } tile_job;
/* every row tile of one group of 16 weight rows */
static void group_rows(void *ctx, long g) {
    const tile_job *j = ctx;
    for (int r0 = 0; r0 < j->M; r0 += RT)
        j->tiles[(j->M - r0 < RT ? j->M - r0 : RT) - 1](j->qs, j->xq, j->dx, j->sx, j->y, r0, (int)g, j->N, j->K);
}
/* y (M, N) = x (M, K) times packed weights, x rounded to int8 per block first (xor_128: offset to
   unsigned bytes, for the Q8_0 tiles with VNNI); each group of 16 weight rows takes every row tile */
static void run_tiles(const group_tile *tiles, int xor_128, const float *x, const uint8_t *qs, float *y,
                      int M, int N, int K) {
    long rows_blocks = (long)M * (K / QB);
    int8_t *xq = aligned_alloc(64, ((size_t)M * K + 63) / 64 * 64);
    float *dx = malloc(sizeof(float) * rows_blocks * 2), *sx = dx + rows_blocks;
    quantize_q8(x, rows_blocks, xq, dx, sx);
    if (xor_128)
        for (long i = 0; i < (long)M * K; i++) xq[i] ^= (int8_t)0x80;      /* xq + 128, as unsigned bytes */
    int groups = N / 16;
    tile_job job = {tiles, qs, xq, dx, sx, y, M, N, K};
    run_shared(groups, group_rows, &job);
    free(xq);
    free(dx);
}

/* y (M, N) = x (M, K) times the packed Q4_1 weights qs (N / 16, K / 32, 320); N % 16 == 0, K % 32 == 0 */
void q41x16_gemm(const float *x, const uint8_t *qs, float *y, int M, int N, int K) {
    run_tiles(Q41_TILES, 0, x, qs, y, M, N, K);
}

/* Q8_0 (GGUF's 8-bit blocks: w = d * q, q int8), the output head of SmolLM2's file, the same way:
   per 16 weight rows and block of 32, 8 chunks of 64 bytes (chunk c: each row's q[4c .. 4c+3]) and
   the 16 d as float16: 544 bytes. Signed times signed: with VNNI x is offset to unsigned (xq + 128)
   and 128 * sum(q) taken off again; without, |q| times xq with q's sign (vpsignb), whose pairs
   cannot saturate. Both give the exact integer sums, so every build gives the same bits. */
#define Q8_GB_BYTES 544
#ifdef __AVX512F__
#ifdef __AVX512VNNI__
#define Q8_OFFSET 1
#define DOT8(acc, x, w) _mm512_dpbusd_epi32((acc), (x), (w))
#else
#define Q8_OFFSET 0
static inline __m512i dot8_signed(__m512i acc, __m512i x, __m512i w) {
    __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), xs), _mm512_set1_epi16(1)));
}
#define DOT8(acc, x, w) dot8_signed((acc), (x), (w))
#endif
#define Q8_TILE(MR)                                                                                \
static void q8group_##MR(const uint8_t *qs, const int8_t *xq, const float *dx, const float *sx,     \
                         float *y, int r0, int g, int N, int K) {     /* sx: unused (no mins) */    \
    const int blocks = K / QB;                                                                     \
    __m512 out[MR];                                                                                \
    for (int r = 0; r < MR; r++) out[r] = _mm512_setzero_ps();                                     \
    for (int b = 0; b < blocks; b++) {                                                             \
        long gb = (long)g * blocks + b;                                                            \
        const uint8_t *p = qs + gb * Q8_GB_BYTES;                                                  \
        prefetch_ahead(p, Q8_GB_BYTES); \
        __m512i w[8], corr = _mm512_setzero_si512();                                               \
        for (int c = 0; c < 8; c++) w[c] = _mm512_loadu_si512(p + 64 * c);                         \
        if (Q8_OFFSET) {                                                                           \
            for (int c = 0; c < 8; c++) corr = DOT8(corr, _mm512_set1_epi8(1), w[c]);              \
            corr = _mm512_slli_epi32(corr, 7);                                                     \
        }                                                                                          \
        __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 512)));               \
        for (int r = 0; r < MR; r++) {                                                             \
            const int32_t *xr = (const int32_t *)(xq + (long)(r0 + r) * K + b * QB);               \
            __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();                      \
            for (int c = 0; c < 4; c++) {                                                          \
                a0 = DOT8(a0, _mm512_set1_epi32(xr[c]), w[c]);                                     \
                a1 = DOT8(a1, _mm512_set1_epi32(xr[4 + c]), w[4 + c]);                             \
            }                                                                                      \
            __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(a0, a1), corr));       \
            out[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(dv, _mm512_set1_ps(dx[(long)(r0 + r) * blocks + b])), out[r]); \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(y + (long)(r0 + r) * N + g * 16, out[r]);        \
}
#else
#ifdef __AVXVNNI__
#define Q8_OFFSET 1
#define DOT8(acc, x, w) _mm256_dpbusd_avx_epi32((acc), (x), (w))
#else
#define Q8_OFFSET 0
#define DOT8(acc, x, w) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), \
                                         _mm256_sign_epi8((x), (w))), _mm256_set1_epi16(1)))
#endif
#define Q8_TILE(MR)                                                                                \
static void q8group_##MR(const uint8_t *qs, const int8_t *xq, const float *dx, const float *sx,     \
                         float *y, int r0, int g, int N, int K) {     /* sx: unused (no mins) */    \
    const int blocks = K / QB;                                                                     \
    for (int half = 0; half < 2; half++) {                                                         \
        __m256 out[MR];                                                                            \
        for (int r = 0; r < MR; r++) out[r] = _mm256_setzero_ps();                                 \
        for (int b = 0; b < blocks; b++) {                                                         \
            long gb = (long)g * blocks + b;                                                        \
            const uint8_t *p = qs + gb * Q8_GB_BYTES + 32 * half;                                  \
            if (!half)                                                                             \
                prefetch_ahead(p, Q8_GB_BYTES); \
            __m256i w[8], corr = _mm256_setzero_si256();                                           \
            for (int c = 0; c < 8; c++) w[c] = _mm256_loadu_si256((const __m256i *)(p + 64 * c));  \
            if (Q8_OFFSET) {                                                                       \
                for (int c = 0; c < 8; c++) corr = DOT8(corr, _mm256_set1_epi8(1), w[c]);          \
                corr = _mm256_slli_epi32(corr, 7);                                                 \
            }                                                                                      \
            __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 512 - 16 * half))); \
            for (int r = 0; r < MR; r++) {                                                         \
                const int32_t *xr = (const int32_t *)(xq + (long)(r0 + r) * K + b * QB);           \
                __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();                  \
                for (int c = 0; c < 4; c++) {                                                      \
                    a0 = DOT8(a0, _mm256_set1_epi32(xr[c]), w[c]);                                 \
                    a1 = DOT8(a1, _mm256_set1_epi32(xr[4 + c]), w[4 + c]);                         \
                }                                                                                  \
                __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(a0, a1), corr));   \
                out[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(dv, _mm256_set1_ps(dx[(long)(r0 + r) * blocks + b])), out[r]); \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < MR; r++) _mm256_storeu_ps(y + (long)(r0 + r) * N + g * 16 + 8 * half, out[r]); \
    }                                                                                              \
}
#endif
Q8_TILE(1) Q8_TILE(2) Q8_TILE(3) Q8_TILE(4) Q8_TILE(5) Q8_TILE(6) Q8_TILE(7) Q8_TILE(8)

static const group_tile Q80_TILES[8] = {q8group_1, q8group_2, q8group_3, q8group_4,
                                         q8group_5, q8group_6, q8group_7, q8group_8};

/* y (M, N) = x (M, K) times the packed Q8_0 weights qs (N / 16, K / 32, 544); N % 16 == 0, K % 32 == 0 */
void q80x16_gemm(const float *x, const uint8_t *qs, float *y, int M, int N, int K) {
    run_tiles(Q80_TILES, Q8_OFFSET, x, qs, y, M, N, K);
}
