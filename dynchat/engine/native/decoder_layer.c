/* One Llama decoder layer on Q4_1, int8 or float32 weights, for n rows at once, each row computed exactly
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

typedef struct {
    const void *w;         /* Q4_1 nibbles (scale and mins: d and m), int8 (scale) or float32 (neither) */
    const float *scale;
    const float *mins;
    const float *bias;     /* may be NULL */
    int out, in;
} qlinear;

static void linear(const qlinear *l, const float *x, float *y, int n) {
    if (l->mins)
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

static inline void axpy(float p, const float *v, float *out, int d) {      /* out += p * v */
    __m256 pv = _mm256_set1_ps(p);
    int i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
    for (; i < d; i++) out[i] += p * v[i];
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

/* scratch: n * (2 * H + (Q + 2 * KV) + Q + 3 * inter) floats */
void decoder_layer(float *x, int n, int H, float eps,
                   const float *ln1, const float *ln2,
                   const void *w_qkv, const float *s_qkv, const float *m_qkv, const float *b_qkv,
                   const void *w_o, const float *s_o, const float *m_o, const float *b_o,
                   const void *w_gu, const float *s_gu, const float *m_gu, const float *b_gu,
                   const void *w_d, const float *s_d, const float *m_d, const float *b_d,
                   int nh, int nkv, int hd, int inter,
                   float *k_cache, float *v_cache, int cap, int start,
                   const float *cos, const float *sin,
                   const int *keys, const int *n_keys, int max_keys,
                   float *scratch) {
    int Q = nh * hd, KV = nkv * hd, QKV = Q + 2 * KV;
    qlinear qkv = {w_qkv, s_qkv, m_qkv, b_qkv, QKV, H}, o = {w_o, s_o, m_o, b_o, H, Q};
    qlinear gu = {w_gu, s_gu, m_gu, b_gu, 2 * inter, H}, down = {w_d, s_d, m_d, b_d, H, inter};
    float *h = scratch, *qkv_out = h + (long)n * H, *att = qkv_out + (long)n * QKV;
    float *gu_out = att + (long)n * Q, *act = gu_out + (long)n * 2 * inter, *proj = act + (long)n * inter;
    float scale = 1.0f / sqrtf((float)hd);
    int group = nh / nkv;

    for (int r = 0; r < n; r++) rms_norm(x + (long)r * H, ln1, h + (long)r * H, H, eps);
    linear(&qkv, h, qkv_out, n);
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
        float best = -INFINITY;
        for (int j = 0; j < count; j++) {
            sc[j] = dot(q, kc + (long)(slots ? slots[j] : j) * hd, hd) * scale;
            if (sc[j] > best) best = sc[j];
        }
        float total = 0.0f;
        for (int j = 0; j < count; j++) {
            sc[j] = expf(sc[j] - best);
            total += sc[j];
        }
        float *out = att + (long)r * Q + (long)head * hd;
        memset(out, 0, hd * sizeof(float));
        for (int j = 0; j < count; j++) axpy(sc[j] / total, vc + (long)(slots ? slots[j] : j) * hd, out, hd);
    }
    free(sc);
    }
    linear(&o, att, proj, n);
    for (long i = 0; i < (long)n * H; i++) x[i] += proj[i];
    for (int r = 0; r < n; r++) rms_norm(x + (long)r * H, ln2, h + (long)r * H, H, eps);
    linear(&gu, h, gu_out, n);
    for (int r = 0; r < n; r++)
        for (int j = 0; j < inter; j++) {
            float g = gu_out[(long)r * 2 * inter + j], u = gu_out[(long)r * 2 * inter + inter + j];
            act[(long)r * inter + j] = g / (1.0f + expf(-g)) * u;
        }
    linear(&down, act, proj, n);
    for (long i = 0; i < (long)n * H; i++) x[i] += proj[i];
}
