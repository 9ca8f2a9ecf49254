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

static inline float dot(const float *a, const float *b, int d) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float s = _mm_cvtss_f32(h);
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

/* Scores of q against 4 keys at once (four accumulators, one reduction): the per-key horizontal sum
   of dot() made attention latency-bound. Each score is summed in a fixed order (lanes, then pairs). */
static inline __m128 dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3, int d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < d; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
    }
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* out[0 .. 63] = sum_j p[j] * v_j[0 .. 63]: eight accumulators in registers across the keys */
static inline void weighted_sum64(const float *p, const float *vc, const int *slots, int count, int hd, float *out) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int j = 0; j < count; j++) {
        const float *v = vc + (long)(slots ? slots[j] : j) * hd;
        __m256 pj = _mm256_set1_ps(p[j]);
        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

static inline void axpy(float p, const float *v, float *out, int d) {      /* out += p * v */
    __m256 pv = _mm256_set1_ps(p);
    int i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
    for (; i < d; i++) out[i] += p * v[i];
}

/* e^x in 8 lanes (Cephes' polynomial: ~2 ulp; -88.4 <= x <= 88.4, beyond clamped). Each lane is computed
   alone, so a value does not depend on its neighbours: the softmax and SiLU below stay row-independent.
   Scalar expf over every attention score and every MLP activation was a fifth of a 5-token verify. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(x, x)), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* The lanes of a count-long array's last partial vector (loads and stores only these). */
static inline __m256i tail_mask(int left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* sc[0 .. count) = softmax(sc): max, e^(s - max), their sum (8 partial sums, then in lane order), division */
static void softmax(float *sc, int count) {
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
    for (int j = 0; j < count; j += 8) {
        __m256i mask = tail_mask(count - j);
        __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(sc + j, mask), mx));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mask));
        _mm256_maskstore_ps(sc + j, mask, e);
        total = _mm256_add_ps(total, e);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, total);
    for (int i = 0; i < 8; i++) sum += lanes[i];
    __m256 t = _mm256_set1_ps(sum);
    for (int j = 0; j < count; j += 8) {
        __m256i mask = tail_mask(count - j);
        _mm256_maskstore_ps(sc + j, mask, _mm256_div_ps(_mm256_maskload_ps(sc + j, mask), t));
    }
}

/* act = silu(g) * u over n rows of inter, 8 lanes at a time, rows spread over the threads */
static void silu_mul(const float *gu, float *act, int n, int inter) {
    #pragma omp parallel for schedule(static) if (n > 1)
    for (int r = 0; r < n; r++)
        for (int j = 0; j < inter; j += 8) {
            __m256i mask = tail_mask(inter - j);
            const float *g_row = gu + (long)r * 2 * inter + j;
            __m256 g = _mm256_maskload_ps(g_row, mask), u = _mm256_maskload_ps(g_row + inter, mask);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_maskstore_ps(act + (long)r * inter + j, mask, _mm256_mul_ps(s, u));
        }
}

static void rms_norm(const float *x, const float *w, float *out, int H, float eps) {
    float ss = 0.0f;
    for (int j = 0; j < H; j++) ss += x[j] * x[j];
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
   q/k/v, RoPE, cache write, attention, output, residual into x, MLP, residual.
   scratch: n * ((Q + 2 * KV) + Q + 3 * inter + H) floats */
static void layer(float *x, float *h_in, int in_width, int n, int H, float eps, const float *ln2,
                  const qlinear *qkv, const qlinear *o, const qlinear *gu, const qlinear *down,
                  int nh, int nkv, int hd, int inter, float *k_cache, float *v_cache, int cap, int start,
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
            memcpy(k_cache + ((long)g * cap + start + r) * hd, row + Q + (long)g * hd, hd * sizeof(float));
            memcpy(v_cache + ((long)g * cap + start + r) * hd, row + Q + KV + (long)g * hd, hd * sizeof(float));
        }
    }
    #pragma omp parallel
    {
    float *sc = malloc((size_t)max_keys * sizeof(float));       /* one row of scores per thread */
    #pragma omp for schedule(static)
    for (int task = 0; task < n * nh; task++) {
        int r = task / nh, head = task % nh;
        const float *q = qkv_out + (long)r * QKV + (long)head * hd;
        const float *kc = k_cache + (long)(head / group) * cap * hd, *vc = v_cache + (long)(head / group) * cap * hd;
        const int *slots = keys ? keys + (long)r * max_keys : NULL;
        int count = n_keys[r];
        int j = 0;
        if (hd % 8 == 0)
            for (; j + 4 <= count; j += 4) {
#define KEY(t) (kc + (long)(slots ? slots[j + (t)] : j + (t)) * hd)
                _mm_storeu_ps(sc + j, _mm_mul_ps(dot4(q, KEY(0), KEY(1), KEY(2), KEY(3), hd), _mm_set1_ps(scale)));
#undef KEY
            }
        for (; j < count; j++) sc[j] = dot(q, kc + (long)(slots ? slots[j] : j) * hd, hd) * scale;
        softmax(sc, count);
        float *out = att + (long)r * Q + (long)head * hd;
        if (hd % 64 == 0)
            for (int c = 0; c < hd; c += 64) weighted_sum64(sc, vc + c, slots, count, hd, out + c);
        else {
            memset(out, 0, hd * sizeof(float));
            for (j = 0; j < count; j++) axpy(sc[j], vc + (long)(slots ? slots[j] : j) * hd, out, hd);
        }
    }
    free(sc);
    }
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
    float *k_cache, float *v_cache, int cap, int start,                                            \
    const float *cos, const float *sin,                                                            \
    const int *keys, const int *n_keys, int max_keys,                                              \
    float *scratch

/* A target's decoder layer. scratch: n * (2 * H + (Q + 2 * KV) + Q + 3 * inter) floats */
void decoder_layer(float *x, int n, int H, float eps, const float *ln1, const float *ln2, LAYER_ARGS) {
    int Q = nh * hd, QKV = Q + 2 * nkv * hd;
    LINEARS(H)
    float *h = scratch;
    for (int r = 0; r < n; r++) rms_norm(x + (long)r * H, ln1, h + (long)r * H, H, eps);
    layer(x, h, H, n, H, eps, ln2, &qkv, &o, &gu, &down, nh, nkv, hd, inter, k_cache, v_cache, cap, start,
          cos, sin, keys, n_keys, max_keys, scratch + (long)n * H);
}

/* An EAGLE-3 head's layer (a draft step): q/k/v read [ln_emb(emb) ; ln_hidden(x)], 2H wide, and x
   (the fc'd target features or the head's previous output) is the residual. One call instead of
   the ~30 PyTorch operators whose per-call cost made most of a draft step.
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
    layer(x, h, 2 * H, n, H, eps, ln2, &qkv, &o, &gu, &down, nh, nkv, hd, inter, k_cache, v_cache, cap, start,
          cos, sin, keys, n_keys, max_keys, scratch + (long)n * 2 * H);
}
