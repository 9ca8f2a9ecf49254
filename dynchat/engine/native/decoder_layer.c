/* One Llama decoder layer on Q4_1 (float32 or int8 activations), int8 or float32 weights, for n rows at once, each row computed exactly
   as it would be alone: the lean forward's int8 and native float32 routes on x86 CPUs with AVX2
   (see gemm.c).

   Why: on SmolLM2 (30 layers x 576) the per-operator cost of a PyTorch layer (norms, RoPE, cache
   writes, attention, activation: ~50 small operators) took as long as streaming the int8 weights,
   and a sixth of a float32 step.
   Here a layer is one call: RMSNorm, fused q/k/v matmul (+bias), RoPE, the new keys and values
   written to the cache, attention of each row over its own key slots (a causal prefix, or the
   prefix and its tree ancestors), output matmul, residual, RMSNorm, fused gate/up matmul, SiLU,
   down matmul, residual. x is updated in place.

   Row independence (what makes a k-token verify give the same bits as k single steps): every
   per-row quantity is computed from that row and the cache alone, in a fixed order. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void int8_gemm(const float *x, const int8_t *w, const float *scale, float *y, int M, int N, int K);
void f32_gemm(const float *x, const float *w, float *y, int M, int N, int K);
void q41_gemm(const float *x, const uint8_t *qs, const float *d, const float *m, float *y, int M, int N, int K);
void q41x16_gemm(const float *x, const uint8_t *qs, float *y, int M, int N, int K);
void q80x16_gemm(const float *x, const uint8_t *qs, float *y, int M, int N, int K);

typedef struct {
    const void *w;         /* Q4_1 nibbles (scale and mins: d and m), int8 (scale) or float32 (neither) */
    const float *scale;
    const float *mins;
    const float *bias;     /* may be NULL */
    int out, in;
    int packed;            /* w packed for integer dot products (int_dot.c): 1 Q4_1 blocks, 2 Q8_0 blocks */
} qlinear;

static void linear(const qlinear *l, const float *x, float *y, int n) {
    if (l->packed == 2)
        q80x16_gemm(x, (const uint8_t *)l->w, y, n, l->out, l->in);
    else if (l->packed)
        q41x16_gemm(x, (const uint8_t *)l->w, y, n, l->out, l->in);
    else if (l->mins)
        q41_gemm(x, (const uint8_t *)l->w, l->scale, l->mins, y, n, l->out, l->in);
    else if (l->scale)
        int8_gemm(x, (const int8_t *)l->w, l->scale, y, n, l->out, l->in);
    else
        f32_gemm(x, (const float *)l->w, y, n, l->out, l->in);
    if (l->bias)
        for (int r = 0; r < n; r++)
            for (int j = 0; j < l->out; j++) y[(long)r * l->out + j] += l->bias[j];
}

/* The key/value cache holds float32, or float16 where kv_half (llama.cpp's default cache type: half the
   bytes a long context's attention streams); either is read as float32 lanes. Offsets count elements. */
static inline __m256 load_kv(const void *base, long at, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at)))
                : _mm256_loadu_ps((const float *)base + at);
}

static inline float kv_at(const void *base, long at, int half) {
    return half ? _cvtsh_ss(((const uint16_t *)base)[at]) : ((const float *)base)[at];
}

/* d floats into the cache at `at` (float16: rounded to nearest even, as PyTorch converts) */
static inline void store_kv(void *base, long at, const float *src, int d, int half) {
    if (!half) {
        memcpy((float *)base + at, src, d * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)base + at;
    int i = 0;
    for (; i + 8 <= d; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < d; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

static inline float dot_kv(const float *a, const void *base, long at, int d, int half) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_kv(base, at + i, half), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float s = _mm_cvtss_f32(h);
    for (; i < d; i++) s += a[i] * kv_at(base, at + i, half);
    return s;
}

static inline void axpy_kv(float p, const void *base, long at, float *out, int d, int half) {      /* out += p * v */
    __m256 pv = _mm256_set1_ps(p);
    int i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, load_kv(base, at + i, half), _mm256_loadu_ps(out + i)));
    for (; i < d; i++) out[i] += p * kv_at(base, at + i, half);
}

/* e^x lane by lane (Cephes' polynomial: ~2 ulp; -88.4 <= x <= 88.4, beyond clamped), written once for
   both widths: exp8 (8 lanes) and, on AVX-512, exp16 run the same operations, so a lane's value is the
   same in either, and does not depend on its neighbours: the softmax and SiLU below stay row-independent.
   Why: scalar expf over every attention score and every MLP activation costs about a fifth of a
   5-token verify on SmolLM2. FLOOR: the width's round-down. */
#define DEFINE_EXP(NAME, T, TI, W, FLOOR)                                                              \
static inline T NAME(T x) {                                                                           \
    x = _mm##W##_min_ps(_mm##W##_max_ps(x, _mm##W##_set1_ps(-88.3762626647949f)), _mm##W##_set1_ps(88.3762626647949f)); \
    T n = FLOOR(_mm##W##_add_ps(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504088896341f)), _mm##W##_set1_ps(0.5f))); \
    x = _mm##W##_sub_ps(x, _mm##W##_mul_ps(n, _mm##W##_set1_ps(0.693359375f)));                      \
    x = _mm##W##_sub_ps(x, _mm##W##_mul_ps(n, _mm##W##_set1_ps(-2.12194440e-4f)));                    \
    T y = _mm##W##_set1_ps(1.9875691500e-4f);                                                         \
    y = _mm##W##_add_ps(_mm##W##_mul_ps(y, x), _mm##W##_set1_ps(1.3981999507e-3f));                   \
    y = _mm##W##_add_ps(_mm##W##_mul_ps(y, x), _mm##W##_set1_ps(8.3334519073e-3f));                   \
    y = _mm##W##_add_ps(_mm##W##_mul_ps(y, x), _mm##W##_set1_ps(4.1665795894e-2f));                   \
    y = _mm##W##_add_ps(_mm##W##_mul_ps(y, x), _mm##W##_set1_ps(1.6666665459e-1f));                   \
    y = _mm##W##_add_ps(_mm##W##_mul_ps(y, x), _mm##W##_set1_ps(5.0000001201e-1f));                   \
    y = _mm##W##_add_ps(_mm##W##_add_ps(_mm##W##_mul_ps(y, _mm##W##_mul_ps(x, x)), x), _mm##W##_set1_ps(1.0f)); \
    TI e = _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvttps_epi32(n), _mm##W##_set1_epi32(127)), 23); \
    return _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(e));                                              \
}
#define FLOOR8(v) _mm256_floor_ps(v)
DEFINE_EXP(exp8, __m256, __m256i, 256, FLOOR8)
#ifdef __AVX512F__
#define FLOOR16(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
DEFINE_EXP(exp16, __m512, __m512i, 512, FLOOR16)
#endif

/* The lanes of a count-long array's last partial vector (loads and stores only these). */
static inline __m256i tail_mask(int left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* sc[0 .. count) = e^(sc - max), and the max and the sum of those (8 partial sums, then in lane order) */
static void exp_scores(float *sc, int count, float *max_out, float *sum_out) {
    __m256 best = _mm256_set1_ps(-INFINITY), total = _mm256_setzero_ps();
    for (int j = 0; j < count; j += 8) {
        __m256i mask = tail_mask(count - j);
        __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(sc + j, mask), _mm256_castsi256_ps(mask));
        best = _mm256_max_ps(best, s);
    }
    __m128 b4 = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
    b4 = _mm_max_ps(b4, _mm_movehl_ps(b4, b4));
    b4 = _mm_max_ss(b4, _mm_movehdup_ps(b4));
    __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(b4));
    int j = 0;
#ifdef __AVX512F__
    /* 16 lanes at a time where they are whole: exp16's lanes are exp8's, each 8 added to the same partial
       sums in the same order */
    __m512 mx16 = _mm512_broadcastss_ps(_mm256_castps256_ps128(mx));
    for (; j + 16 <= count; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mx16));
        _mm512_storeu_ps(sc + j, e);
        total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
        total = _mm256_add_ps(total, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
#endif
    for (; j < count; j += 8) {
        __m256i mask = tail_mask(count - j);
        __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(sc + j, mask), mx));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mask));
        _mm256_maskstore_ps(sc + j, mask, e);
        total = _mm256_add_ps(total, e);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, total);
    for (int i = 0; i < 8; i++) sum += lanes[i];
    *max_out = _mm256_cvtss_f32(mx);
    *sum_out = sum;
}

/* act[0 .. count) of one row = silu(g) * u (g, u: the row's gate and up halves); 16 lanes at a time on
   AVX-512, then 8 */
static void silu_mul_row(const float *g_row, const float *u_row, float *act_row, int count) {
    int j = 0;
#ifdef __AVX512F__
    for (; j + 16 <= count; j += 16) {
        __m512 g = _mm512_loadu_ps(g_row + j), u = _mm512_loadu_ps(u_row + j);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(act_row + j, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u));
    }
#endif
    for (; j < count; j += 8) {
        __m256i mask = tail_mask(count - j);
        __m256 g = _mm256_maskload_ps(g_row + j, mask), u = _mm256_maskload_ps(u_row + j, mask);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_maskstore_ps(act_row + j, mask, _mm256_mul_ps(s, u));
    }
}

/* act = silu(g) * u over n rows of inter, rows spread over the threads (a step's one row costs less
   than waking the other thread) */
static void silu_mul(const float *gu, float *act, int n, int inter) {
    #pragma omp parallel for schedule(static) if (n > 1)
    for (int r = 0; r < n; r++)
        silu_mul_row(gu + (long)r * 2 * inter, gu + (long)r * 2 * inter + inter, act + (long)r * inter, inter);
}

/* Attention of G query heads (consecutive, hd apart: those sharing one key/value head) over the keys
   lo .. hi of a row's count cached keys: out = sum of e^(score - max) * value, unnormalized, with the
   max and the sum of e^(score - max) per head (attend_rows merges and divides). Each key and value is
   loaded once for the G heads. Every score and output is summed in an order fixed by the key range
   alone (4 keys' scores in 8-lane accumulators reduced together, values weighted in key order per
   lane), whatever G or the number of rows: rows stay independent. */
#define HEADS_AT_ONCE 3
#define KV_AHEAD 8          /* keys ahead whose rows are prefetched into L1 */

/* bytes of the cache from element `at` (esz bytes each) into L1 */
static inline void prefetch_kv(const void *base, long at, int bytes, int esz) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)base + at * esz + o, _MM_HINT_T0);
}
static inline __attribute__((always_inline)) void scores4(const float *q, int G, int hd, const void *kc, long k0, long k1,
                                                          long k2, long k3, int half, float scale, float *sc, int ms) {
    __m256 a[HEADS_AT_ONCE][4];
    for (int h = 0; h < G; h++)
        for (int t = 0; t < 4; t++) a[h][t] = _mm256_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        __m256 kv0 = load_kv(kc, k0 + i, half), kv1 = load_kv(kc, k1 + i, half);
        __m256 kv2 = load_kv(kc, k2 + i, half), kv3 = load_kv(kc, k3 + i, half);
        for (int h = 0; h < G; h++) {
            __m256 qv = _mm256_loadu_ps(q + (long)h * hd + i);
            a[h][0] = _mm256_fmadd_ps(qv, kv0, a[h][0]);
            a[h][1] = _mm256_fmadd_ps(qv, kv1, a[h][1]);
            a[h][2] = _mm256_fmadd_ps(qv, kv2, a[h][2]);
            a[h][3] = _mm256_fmadd_ps(qv, kv3, a[h][3]);
        }
    }
    for (int h = 0; h < G; h++) {
        __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        _mm_storeu_ps(sc + (long)h * ms, _mm_mul_ps(s4, _mm_set1_ps(scale)));
    }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* Two keys' 8 lanes (a0's and a1's elements at .. at + 8) in one 16-lane register */
static inline __m512 load_kv2(const void *base, long a0, long a1, int half) {
    if (half)
        return _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + a0))),
            _mm_loadu_si128((const __m128i *)((const uint16_t *)base + a1)), 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps((const float *)base + a0)),
                              _mm256_loadu_ps((const float *)base + a1), 1);
}

/* scores4 for 8 keys, each 16-lane register holding two keys' 8-lane accumulators: every lane sums the
   same products in the same order, and each key's 8 lanes are reduced as scores4 reduces them, so the
   scores are scores4's bit for bit, with half the multiply-add instructions (on a CPU whose 512-bit
   units are full width, half the time). */
static inline __attribute__((always_inline)) void scores8(const float *q, int G, int hd, const void *kc, const long *k,
                                                          int half, float scale, float *sc, int ms) {
    __m512 a[HEADS_AT_ONCE][4];
    for (int h = 0; h < G; h++)
        for (int t = 0; t < 4; t++) a[h][t] = _mm512_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        __m512 kv[4];
        for (int t = 0; t < 4; t++) kv[t] = load_kv2(kc, k[2 * t] + i, k[2 * t + 1] + i, half);
        for (int h = 0; h < G; h++) {
            __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + (long)h * hd + i));
            for (int t = 0; t < 4; t++) a[h][t] = _mm512_fmadd_ps(qv, kv[t], a[h][t]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int b = 0; b < 2; b++) {          /* keys 4b .. 4b + 3, as scores4 reduces them */
            __m512 x = a[h][2 * b], y = a[h][2 * b + 1];
            __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1)),
                                      _mm256_hadd_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1)));
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            _mm_storeu_ps(sc + (long)h * ms + 4 * b, _mm_mul_ps(s4, _mm_set1_ps(scale)));
        }
}

/* out (G heads x 64 lanes from c) = the keys' values weighted by the scores, in key order per lane: the
   8-lane loop's sums, 16 lanes a register and the 64 lanes of a head at once (12 accumulators: enough
   multiply-adds in flight) */
static inline __attribute__((always_inline)) void weigh64(const void *vc, const int *slots, int lo, int count, int hd,
                                                          int c, int half, const float *sc, int ms, int G, float *out) {
    __m512 acc[HEADS_AT_ONCE][4];
    for (int h = 0; h < G; h++)
        for (int i = 0; i < 4; i++) acc[h][i] = _mm512_setzero_ps();
    for (int t = 0; t < count; t++) {
        long v = (long)(slots ? slots[lo + t] : lo + t) * hd + c;
        if (t + KV_AHEAD < count)
            prefetch_kv(vc, (long)(slots ? slots[lo + t + KV_AHEAD] : lo + t + KV_AHEAD) * hd + c, 64 * (half ? 2 : 4),
                        half ? 2 : 4);
        __m512 vv[4];
        for (int i = 0; i < 4; i++)
            vv[i] = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)vc + v + 16 * i)))
                         : _mm512_loadu_ps((const float *)vc + v + 16 * i);
        for (int h = 0; h < G; h++) {
            __m512 p = _mm512_set1_ps(sc[(long)h * ms + t]);
            for (int i = 0; i < 4; i++) acc[h][i] = _mm512_fmadd_ps(p, vv[i], acc[h][i]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + (long)h * hd + c + 16 * i, acc[h][i]);
}
#define WIDE_ATTENTION 1
#else
#define WIDE_ATTENTION 0
#endif

static inline __attribute__((always_inline)) void attend_part(const float *q, int G, const void *kc, const void *vc,
                                                              const int *slots, int lo, int hi, int half, int ms, int hd,
                                                              float scale, float *sc, float *out, float *mx, float *sum) {
    int j = 0, count = hi - lo;
#define AT(t) ((long)(slots ? slots[lo + (t)] : lo + (t)) * hd)        /* key t's offset in the cache */
    const int esz = half ? 2 : 4, row_bytes = hd * esz;
#if WIDE_ATTENTION
    if (hd % 8 == 0)
        for (; j + 8 <= count; j += 8) {
            long k[8];
            for (int t = 0; t < 8; t++) k[t] = AT(j + t);
            if (j + KV_AHEAD + 8 <= count)
                for (int t = j + KV_AHEAD; t < j + KV_AHEAD + 8; t++) prefetch_kv(kc, AT(t), row_bytes, esz);
            scores8(q, G, hd, kc, k, half, scale, sc + j, ms);
        }
#endif
    if (hd % 8 == 0)
        for (; j + 4 <= count; j += 4) {
            if (j + KV_AHEAD + 4 <= count)
                for (int t = j + KV_AHEAD; t < j + KV_AHEAD + 4; t++) prefetch_kv(kc, AT(t), row_bytes, esz);
            scores4(q, G, hd, kc, AT(j), AT(j + 1), AT(j + 2), AT(j + 3), half, scale, sc + j, ms);
        }
    for (int h = 0; h < G; h++)
        for (int t = j; t < count; t++) sc[(long)h * ms + t] = dot_kv(q + (long)h * hd, kc, AT(t), hd, half) * scale;
    for (int h = 0; h < G; h++) exp_scores(sc + (long)h * ms, count, mx + h, sum + h);
#if WIDE_ATTENTION
    if (hd % 64 == 0) {
        for (int c = 0; c < hd; c += 64) weigh64(vc, slots, lo, count, hd, c, half, sc, ms, G, out);
        return;
    }
#endif
    if (hd % 32 == 0)
        for (int c = 0; c < hd; c += 32) {          /* 32 output lanes of each head in registers across the keys */
            __m256 acc[HEADS_AT_ONCE][4];
            for (int h = 0; h < G; h++)
                for (int i = 0; i < 4; i++) acc[h][i] = _mm256_setzero_ps();
            for (int t = 0; t < count; t++) {
                long v = AT(t) + c;
                if (t + KV_AHEAD < count) prefetch_kv(vc, AT(t + KV_AHEAD) + c, 32 * esz, esz);
                __m256 v0 = load_kv(vc, v, half), v1 = load_kv(vc, v + 8, half);
                __m256 v2 = load_kv(vc, v + 16, half), v3 = load_kv(vc, v + 24, half);
                for (int h = 0; h < G; h++) {
                    __m256 p = _mm256_set1_ps(sc[(long)h * ms + t]);
                    acc[h][0] = _mm256_fmadd_ps(p, v0, acc[h][0]);
                    acc[h][1] = _mm256_fmadd_ps(p, v1, acc[h][1]);
                    acc[h][2] = _mm256_fmadd_ps(p, v2, acc[h][2]);
                    acc[h][3] = _mm256_fmadd_ps(p, v3, acc[h][3]);
                }
            }
            for (int h = 0; h < G; h++)
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + (long)h * hd + c + 8 * i, acc[h][i]);
        }
    else
        for (int h = 0; h < G; h++) {
            memset(out + (long)h * hd, 0, hd * sizeof(float));
            for (int t = 0; t < count; t++) axpy_kv(sc[(long)h * ms + t], vc, AT(t), out + (long)h * hd, hd, half);
        }
#undef AT
}

/* A row's keys from this many on are attended in two halves, one task each (a plain step has one row
   and 3 key/value heads: 3 tasks on 2 threads left one idle half the time, and a long context's
   attention waits on the memory), merged as flash-decoding does in a fixed order: rows stay independent. */
#define SPLIT_KEYS 64
#define DYNAMIC_ROWS 16
#define ROW_BLOCK 256

/* Where a row of `count` keys is split: the first half's end (a multiple of 4), or count (not split) */
static inline int split_at(int count) {
    return count >= SPLIT_KEYS ? count / 2 / 4 * 4 : count;
}

/* Attention of n rows (queries in qkv, QKV apart) into att (Q apart): a task is one row's query heads that
   share a key/value head (up to HEADS_AT_ONCE of them, so each key and value is read once for all of
   them), over all its keys or over one half of them. */
static void attend_rows(const float *qkv, int QKV, float *att, int Q, int n, int nkv, int group, int hd, float scale,
                        const void *k_cache, const void *v_cache, int kv_half, int cap, const int *keys,
                        const int *n_keys, int max_keys) {
    if (n > ROW_BLOCK) {        /* a long prompt's rows a block at a time: the partial results stay bounded */
        for (int r0 = 0; r0 < n; r0 += ROW_BLOCK)
            attend_rows(qkv + (long)r0 * QKV, QKV, att + (long)r0 * Q, Q, n - r0 < ROW_BLOCK ? n - r0 : ROW_BLOCK, nkv,
                        group, hd, scale, k_cache, v_cache, kv_half, cap, keys ? keys + (long)r0 * max_keys : NULL,
                        n_keys + r0, max_keys);
        return;
    }
    long head_bytes = (long)cap * hd * (kv_half ? 2 : 4);
    int chunks = (group + HEADS_AT_ONCE - 1) / HEADS_AT_ONCE, part = HEADS_AT_ONCE * (hd + 2);
    int tasks = n * nkv * chunks;
    float *parts = malloc((size_t)2 * tasks * part * sizeof(float));    /* per task and half: out, max, sum */
    /* a step's or a verify's few tasks in equal blocks; a prompt's many rows handed out as threads come free:
       a row attends its whole prefix, so equal blocks of rows would leave the first thread a third of the
       work (a 935-token prefill takes ~15% less this way) */
    omp_set_schedule(n >= DYNAMIC_ROWS ? omp_sched_dynamic : omp_sched_static, n >= DYNAMIC_ROWS ? 4 : 0);
    #pragma omp parallel
    {
    float *sc = malloc((size_t)HEADS_AT_ONCE * max_keys * sizeof(float));   /* scores, per thread */
    #pragma omp for schedule(runtime)
    for (int i = 0; i < 2 * tasks; i++) {
        /* a step's or a verify's rows of one head group and half follow each other (each thread reads its
           own share of the cache, and a key read for one row is still cached for the next); a prompt's
           rows come first (each thread takes the next row as it comes free) */
        int task = i;                               /* as parts holds them: 2 * (row's head group) + half */
        if (n < DYNAMIC_ROWS) {
            int row = i % n, group_half = i / n;
            task = 2 * (row * nkv * chunks + group_half / 2) + group_half % 2;
        }
        int t = task / 2, half = task % 2;
        int r = t / (nkv * chunks), g = t / chunks % nkv, skip = t % chunks * HEADS_AT_ONCE;
        int count = n_keys[r], mid = split_at(count);
        if (half && mid == count) continue;
        int first = g * group + skip, heads = group - skip < HEADS_AT_ONCE ? group - skip : HEADS_AT_ONCE;
        const float *q = qkv + (long)r * QKV + (long)first * hd;
        const void *kc = (const char *)k_cache + g * head_bytes, *vc = (const char *)v_cache + g * head_bytes;
        const int *slots = keys ? keys + (long)r * max_keys : NULL;
        int lo = half ? mid : 0, hi = half ? count : mid;
        float *o = parts + (long)task * part, *mx = o + HEADS_AT_ONCE * hd, *sum = mx + HEADS_AT_ONCE;
#define PART(G, H) attend_part(q, G, kc, vc, slots, lo, hi, H, max_keys, hd, scale, sc, o, mx, sum)
        if (kv_half)
            switch (heads) { case 1: PART(1, 1); break; case 2: PART(2, 1); break; default: PART(3, 1); }
        else
            switch (heads) { case 1: PART(1, 0); break; case 2: PART(2, 0); break; default: PART(3, 0); }
#undef PART
    }
    free(sc);
    #pragma omp for schedule(static)
    for (int t = 0; t < tasks; t++) {
        int r = t / (nkv * chunks), g = t / chunks % nkv, skip = t % chunks * HEADS_AT_ONCE;
        int first = g * group + skip, heads = group - skip < HEADS_AT_ONCE ? group - skip : HEADS_AT_ONCE;
        int split = split_at(n_keys[r]) < n_keys[r];
        const float *o0 = parts + (long)2 * t * part, *o1 = o0 + part;
        float *out = att + (long)r * Q + (long)first * hd;
        for (int h = 0; h < heads; h++) {
            float m0 = o0[HEADS_AT_ONCE * hd + h], s0 = o0[HEADS_AT_ONCE * hd + HEADS_AT_ONCE + h];
            float a0 = 1.0f, a1 = 0.0f, s1 = 0.0f;
            if (split) {
                float m1 = o1[HEADS_AT_ONCE * hd + h], m = m0 > m1 ? m0 : m1;
                s1 = o1[HEADS_AT_ONCE * hd + HEADS_AT_ONCE + h];
                a0 = expf(m0 - m);
                a1 = expf(m1 - m);
            }
            float inv = 1.0f / (a0 * s0 + a1 * s1);
            for (int i = 0; i < hd; i++)
                out[(long)h * hd + i] = (split ? a0 * o0[(long)h * hd + i] + a1 * o1[(long)h * hd + i] : o0[(long)h * hd + i]) * inv;
        }
    }
    }
    free(parts);
}

/* out = w * (x * 1 / sqrt(mean(x^2) + eps)). The squares are summed in 32 lanes (four 8-lane sums, then
   lane by lane in a fixed order), the same on every build: one running sum is a chain of H dependent
   adds, twice a layer for every row (a 5-token verify took ~3% longer so). */
static void rms_norm(const float *x, const float *w, float *out, int H, float eps) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int j = 0; j < H; j += 8) {
        __m256 v = _mm256_maskload_ps(x + j, tail_mask(H - j));
        acc[(j >> 3) & 3] = _mm256_add_ps(acc[(j >> 3) & 3], _mm256_mul_ps(v, v));
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    float lanes[8], ss = 0.0f;
    _mm256_storeu_ps(lanes, s);
    for (int i = 0; i < 8; i++) ss += lanes[i];
    float inv = 1.0f / sqrtf(ss / H + eps);
    for (int j = 0; j < H; j++) out[j] = w[j] * (x[j] * inv);
}

static void rope(float *v, const float *cos, const float *sin, int hd) {
    int half = hd / 2;
    for (int j = 0; j < half; j++) {
        float a = v[j], b = v[j + half];
        v[j] = a * cos[j] - b * sin[j];
        v[j + half] = b * cos[j + half] + a * sin[j + half];
    }
}

/* The layer from its qkv input h_in (n rows of in_width: normed, and reused for the second norm):
   q/k/v, RoPE, cache write, attention, output, residual into x, MLP, residual. The first `skip` rows
   only write their keys and values (x keeps them as they came): rows whose output nothing reads.
   scratch: n * ((Q + 2 * KV) + Q + 3 * inter + H) floats */
static void layer(float *x, float *h_in, int in_width, int n, int skip, int H, float eps, const float *ln2,
                  const qlinear *qkv, const qlinear *o, const qlinear *gu, const qlinear *down,
                  int nh, int nkv, int hd, int inter, void *k_cache, void *v_cache, int kv_half, int cap, int start,
                  const float *cos, const float *sin, const int *keys, const int *n_keys, int max_keys,
                  float *scratch) {
    int Q = nh * hd, KV = nkv * hd, QKV = Q + 2 * KV;
    float *h = h_in, *qkv_out = scratch, *att = qkv_out + (long)n * QKV;
    float *gu_out = att + (long)n * Q, *act = gu_out + (long)n * 2 * inter, *proj = act + (long)n * inter;
    float scale = 1.0f / sqrtf((float)hd);
    int group = nh / nkv;
    (void)in_width;

    linear(qkv, h, qkv_out, n);
    for (int r = 0; r < n; r++) {
        float *row = qkv_out + (long)r * QKV;
        for (int i = 0; i < nh + nkv; i++) rope(row + (long)i * hd, cos + (long)r * hd, sin + (long)r * hd, hd);
        for (int g = 0; g < nkv; g++) {
            store_kv(k_cache, ((long)g * cap + start + r) * hd, row + Q + (long)g * hd, hd, kv_half);
            store_kv(v_cache, ((long)g * cap + start + r) * hd, row + Q + KV + (long)g * hd, hd, kv_half);
        }
    }
    if (skip) {                  /* the rows left: their queries, residuals and key counts */
        qkv_out += (long)skip * QKV;
        x += (long)skip * H;
        if (keys) keys += (long)skip * max_keys;
        n_keys += skip;
        n -= skip;
    }
    attend_rows(qkv_out, QKV, att, Q, n, nkv, group, hd, scale, k_cache, v_cache, kv_half, cap, keys, n_keys, max_keys);
    linear(o, att, proj, n);
    for (long i = 0; i < (long)n * H; i++) x[i] += proj[i];
    for (int r = 0; r < n; r++) rms_norm(x + (long)r * H, ln2, h + (long)r * H, H, eps);
    linear(gu, h, gu_out, n);
    silu_mul(gu_out, act, n, inter);
    linear(down, act, proj, n);
    for (long i = 0; i < (long)n * H; i++) x[i] += proj[i];
}

#define LINEARS(IN)                                                                                \
    qlinear qkv = {w_qkv, s_qkv, m_qkv, b_qkv, QKV, IN, packed[0]}, o = {w_o, s_o, m_o, b_o, H, Q, packed[1]}; \
    qlinear gu = {w_gu, s_gu, m_gu, b_gu, 2 * inter, H, packed[2]}, down = {w_d, s_d, m_d, b_d, H, inter, packed[3]};
#define LAYER_ARGS                                                                                 \
    const void *w_qkv, const float *s_qkv, const float *m_qkv, const float *b_qkv,                 \
    const void *w_o, const float *s_o, const float *m_o, const float *b_o,                         \
    const void *w_gu, const float *s_gu, const float *m_gu, const float *b_gu,                     \
    const void *w_d, const float *s_d, const float *m_d, const float *b_d,                         \
    const int *packed,      /* per linear (qkv, o, gate/up, down): 1 / 2 where w is int_dot.c's Q4_1 / Q8_0 */ \
    int nh, int nkv, int hd, int inter,                                                            \
    void *k_cache, void *v_cache, int kv_half, int cap, int start,                                 \
    const float *cos, const float *sin,                                                            \
    const int *keys, const int *n_keys, int max_keys,                                              \
    float *scratch

/* A target's decoder layer. scratch: n * (2 * H + (Q + 2 * KV) + Q + 3 * inter) floats */
void decoder_layer(float *x, int n, int H, float eps, const float *ln1, const float *ln2, LAYER_ARGS) {
    int Q = nh * hd, QKV = Q + 2 * nkv * hd;
    LINEARS(H)
    float *h = scratch;
    for (int r = 0; r < n; r++) rms_norm(x + (long)r * H, ln1, h + (long)r * H, H, eps);
    layer(x, h, H, n, 0, H, eps, ln2, &qkv, &o, &gu, &down, nh, nkv, hd, inter, k_cache, v_cache, kv_half, cap, start,
          cos, sin, keys, n_keys, max_keys, scratch + (long)n * H);
}

/* out (n * H) = the embedding's rows for ids; -1 (nothing written) where an id is not one of its rows */
static int embed_rows(const int64_t *ids, int n, const float *embedding, long rows, int H, float *out) {
    for (int r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows) return -1;
    for (int r = 0; r < n; r++) memcpy(out + (long)r * H, embedding + ids[r] * H, H * sizeof(float));
    return 0;
}

/* logits (rows * vocab) = head(RMSNorm(x)) for rows of x, the normed rows in `normed` */
static void output_head(const float *x, int rows, int H, float eps, const float *norm, const qlinear *head,
                        float *normed, float *logits) {
    for (int r = 0; r < rows; r++) rms_norm(x + (long)r * H, norm, normed + (long)r * H, H, eps);
    linear(head, normed, logits, rows);
}

/* LAYER_ARGS' pointers a layer of decoder_stack's table holds */
#define LAYER_POINTERS 19

/* A target's forward in one call: the token ids' embedding rows, every layer, and where `logits` is not
   NULL the final RMSNorm and output head of the last out_rows rows. Per layer the 19 pointers
   decoder_layer takes (ln1, ln2, each linear's weight, scale, mins and bias, the packed flags) come from
   `table`; each layer's keys and values lie layer_bytes after the previous one's. Where capture[i] >= 0
   the layer's input rows are copied first into features (rows start.., feature_width apart, at column
   capture[i] * H): EAGLE-3's features. cos and sin: the n rows' tables; n_keys NULL: row r attends the
   start + r + 1 keys before it (a chain). x (n * H) ends as the last layer's output.
   Why: from Python, 30 layer calls of ~45 arguments and the ~10 small PyTorch operators around them
   cost ~0.4 ms a SmolLM2 step, a sixth of it (each operator's code cold after the weights' stream).
   Returns 0, or -1 (having done nothing) where an id is not a row of the embedding's vocab_rows. */
int decoder_stack(float *x, const int64_t *ids, const float *embedding, long vocab_rows, int n, int H, float eps,
                   const void *const *table, int n_layers, const int *capture, float *features, int feature_width,
                   int nh, int nkv, int hd, int inter, char *k_cache, char *v_cache, long layer_bytes, int kv_half,
                   int cap, int start, const float *cos, const float *sin, const int *keys, const int *n_keys,
                   int max_keys, float *scratch, const float *norm, const void *w_head, const float *s_head,
                   const float *m_head, int head_packed, int vocab, int out_rows, float *logits) {
    if (embed_rows(ids, n, embedding, vocab_rows, H, x)) return -1;
    int *counts = NULL;
    if (!n_keys) {
        counts = malloc((size_t)n * sizeof(int));
        for (int r = 0; r < n; r++) counts[r] = start + r + 1;
        n_keys = counts;
        max_keys = start + n;
    }
    for (int i = 0; i < n_layers; i++) {
        const void *const *t = table + (long)i * LAYER_POINTERS;
        if (capture && capture[i] >= 0)
            for (int r = 0; r < n; r++)
                memcpy(features + (long)(start + r) * feature_width + (long)capture[i] * H, x + (long)r * H,
                       H * sizeof(float));
        decoder_layer(x, n, H, eps, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11], t[12],
                      t[13], t[14], t[15], t[16], t[17], (const int *)t[18], nh, nkv, hd, inter,
                      k_cache + i * layer_bytes, v_cache + i * layer_bytes, kv_half, cap, start, cos, sin, keys, n_keys,
                      max_keys, scratch);
    }
    free(counts);
    if (logits) {
        qlinear head = {w_head, s_head, m_head, NULL, vocab, H, head_packed};
        output_head(x + (long)(n - out_rows) * H, out_rows, H, eps, norm, &head, scratch, logits);
    }
    return 0;
}

/* An EAGLE-3 head's layer (a draft step): q/k/v read [ln_emb(emb) ; ln_hidden(x)], 2H wide, and x
   (the fc'd target features or the head's previous output) is the residual. One call instead of
   the ~30 PyTorch operators whose per-call cost made most of a draft step. Only the last row's output
   is computed (x's last row): a real position's successor reads the target's feature, not the head's
   output, so the rows before it only write their keys and values (a reply's first draft reads the whole
   prompt so: its keys and values, and one row's attention and MLP).
   scratch: n * (3 * H + (Q + 2 * KV) + Q + 3 * inter) floats */
void eagle3_layer(float *x, const float *emb, int n, int H, float eps, const float *ln_emb, const float *ln_hidden,
                  const float *ln2, LAYER_ARGS) {
    int Q = nh * hd, QKV = Q + 2 * nkv * hd;
    LINEARS(2 * H)
    float *h = scratch;
    for (int r = 0; r < n; r++) {
        rms_norm(emb + (long)r * H, ln_emb, h + (long)r * 2 * H, H, eps);
        rms_norm(x + (long)r * H, ln_hidden, h + (long)r * 2 * H + H, H, eps);
    }
    layer(x, h, 2 * H, n, n - 1, H, eps, ln2, &qkv, &o, &gu, &down, nh, nkv, hd, inter, k_cache, v_cache, kv_half, cap,
          start, cos, sin, keys, n_keys, max_keys, scratch + (long)n * 2 * H);
}

long row_argmax(const float *row, long V);      /* argmax.c */

/* An EAGLE-3 head's greedy draft step in one call: the layer over n new positions (a catch-up on the
   target's features, fc'd here, or the token just drafted fed back with the previous output), then the
   last row's draft-vocabulary logits, their argmax as a target id and its softmax probability (the
   lookahead policy's confidence). Why: as PyTorch calls around eagle3_layer, a step cost ~0.13 ms on
   SmolLM2 (a quarter of it the head's arithmetic): most of what a drafted token cost a round.
   x: n rows of H; holds the previous output where feats is NULL (then n is 1); on return row 0 holds
   the last row's output, what the next step feeds back. tokens: the n target ids paired with the rows.
   scratch: n * (5 * H + (Q + 2 * KV) + Q + 3 * inter) + vocab floats and n ints.
   Returns 0, or -1 (having done nothing) where a token is not a row of the embedding's vocab_rows. */
int eagle3_draft(float *x, const float *feats, const int64_t *tokens, const float *embedding, long vocab_rows, int n,
                 int H, float eps, const void *w_fc, const float *s_fc, const float *m_fc, int fc_packed, int fc_in,
                 const float *ln_emb, const float *ln_hidden, const float *ln2, const float *norm,
                 const void *w_lm, const float *s_lm, const float *m_lm, int lm_packed, int vocab,
                 const int64_t *target_ids, int64_t *token_out, float *confidence_out, LAYER_ARGS) {
    float *emb = scratch, *h = emb + (long)n * H, *logits = h + H;
    float *layer_scratch = logits + vocab;
    int *counts = (int *)(layer_scratch + (long)n * (3 * H + nh * hd + 2 * nkv * hd + nh * hd + 3 * inter));
    (void)keys; (void)n_keys; (void)max_keys;
    if (embed_rows(tokens, n, embedding, vocab_rows, H, emb)) return -1;
    if (feats) {
        qlinear fc = {w_fc, s_fc, m_fc, NULL, H, fc_in, fc_packed};
        linear(&fc, feats, x, n);
    }
    for (int r = 0; r < n; r++) counts[r] = start + r + 1;
    eagle3_layer(x, emb, n, H, eps, ln_emb, ln_hidden, ln2, w_qkv, s_qkv, m_qkv, b_qkv, w_o, s_o, m_o, b_o,
                 w_gu, s_gu, m_gu, b_gu, w_d, s_d, m_d, b_d, packed, nh, nkv, hd, inter, k_cache, v_cache, kv_half,
                 cap, start, cos, sin, NULL, counts, start + n, layer_scratch);
    if (n > 1) memcpy(x, x + (long)(n - 1) * H, H * sizeof(float));
    qlinear lm = {w_lm, s_lm, m_lm, NULL, vocab, H, lm_packed};
    output_head(x, 1, H, eps, norm, &lm, h, logits);
    long best = row_argmax(logits, vocab);
    float mx, sum;
    exp_scores(logits, vocab, &mx, &sum);       /* the best token's e^0 = 1 over the sum: its probability */
    *token_out = target_ids[best];
    *confidence_out = 1.0f / sum;
    return 0;
}
