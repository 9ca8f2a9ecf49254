/* Sampling's two per-row steps for logits rows on the CPU: the warped distribution (temperature, then the
   top-p cut, renormalised: Sampler.probs) and a draw from it by one uniform number (Sampler.sample).

   Why: in PyTorch a row of SmolLM2's 49,152 tokens took ~0.4 ms to warp at top-p 0.9 (a dozen operators
   and a Python loop to rank the nucleus's candidates) and ~0.14 ms to draw from (a float64 cumulative sum
   and a search), against a ~5 ms decoding step; every sampled token pays one warp and one draw, a sampled
   verify a warp for each row it reads. Here a warp is four passes over the row and a heap over the few
   hundred candidates that can be in the nucleus; a draw two passes. */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x lane by lane: Cephes' range reduction and polynomial (as decoder_layer.c's exp8, ~2 ulp) in fused
   multiply-adds; 0 below -87 (a token the softmax's float32 could hardly tell from 0 is 0, so a cut at
   -inf from a caller stays a cut) */
static inline __m256 exp_or_zero(__m256 x) {
    __m256 alive = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), alive);
}

/* acc += the 8 lanes of v in float64, as two 4-lane halves; sum4 gives acc's lanes' sum */
static inline __m256d add8_pd(__m256d acc, __m256 v) {
    acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    return _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

static inline double sum4(__m256d acc) {
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(acc), _mm256_extractf128_pd(acc, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

/* the nucleus's candidates: value and token, ordered by value (larger first; on ties the lower token) */
typedef struct { float v; int32_t i; } cand;

static inline int before(cand a, cand b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

static void sift_down(cand *h, long n, long at) {
    cand x = h[at];
    for (;;) {
        long c = 2 * at + 1;
        if (c >= n) break;
        if (c + 1 < n && before(h[c + 1], h[c])) c++;
        if (!before(h[c], x)) break;
        h[at] = h[c];
        at = c;
    }
    h[at] = x;
}

/* Buffers per thread (a row's nucleus candidates, a warped row), grown as rows need, freed when the thread
   ends (a server's worker threads come and go) */
typedef struct { cand *cands; long n_cands; float *row; long n_row; } buffers;
static pthread_key_t buffers_key;
static pthread_once_t buffers_once = PTHREAD_ONCE_INIT;

static void free_buffers(void *b) {
    free(((buffers *)b)->cands);
    free(((buffers *)b)->row);
    free(b);
}

static void make_key(void) { pthread_key_create(&buffers_key, free_buffers); }

static buffers *mine(void) {
    pthread_once(&buffers_once, make_key);
    buffers *b = pthread_getspecific(buffers_key);
    if (!b && (b = calloc(1, sizeof(buffers))) && pthread_setspecific(buffers_key, b)) {
        free(b);
        b = NULL;
    }
    return b;
}

/* *buf with room for n items of `size` bytes, *have of them so far (NULL: none to be had) */
static void *room(void **buf, long *have, long n, size_t size) {
    if (n > *have) {
        void *grown = realloc(*buf, (size_t)n * size);
        if (!grown) return NULL;
        *buf = grown;
        *have = n;
    }
    return *buf;
}

/* room for n candidates */
static cand *candidates(long n) {
    buffers *b = mine();
    return b ? room((void **)&b->cands, &b->n_cands, n, sizeof(cand)) : NULL;
}

/* a row of V floats to warp into */
static float *warp_buffer(long V) {
    buffers *b = mine();
    return b ? room((void **)&b->row, &b->n_row, V, sizeof(float)) : NULL;
}

/* out = the warped distribution of one row: e = exp((x - max) / temperature), and where top_p < 1 only the
   tokens whose more likely tokens hold less than top_p of the mass keep theirs (the most likely always
   does), the rest 0; then scaled by 1 / the sum kept. Only tokens with e >= (1 - top_p) / V of the sum are
   ranked: the tokens below hold less than 1 - top_p together, so each has more than top_p before it.
   Returns 0; -1 where no buffer could be had, -3 where the row has a NaN or no finite largest value (out
   is then not a distribution). */
float row_max(const float *row, long V, int *has_nan);      /* argmax.c */

#define NOT_FINITE (-3)
static int warp_row(const float *x, long V, double temperature, double top_p, float *out) {
    if (!(temperature > 0.0) || V < 1) return NOT_FINITE;
    const double inv_d = 1.0 / temperature;
    const __m256 t = _mm256_set1_ps(inv_d < FLT_MAX ? (float)inv_d : FLT_MAX);
    int has_nan;
    const float mx = row_max(x, V, &has_nan);
    if (has_nan || !isfinite(mx)) return NOT_FINITE;
    long j;

    /* e = exp((x - max) / temperature): the largest is exactly 1 whatever the temperature; a row's last
       partial vector goes through the same code, padded with -inf (e = 0) */
    const __m256 m = _mm256_set1_ps(mx);
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    for (j = 0; j + 16 <= V; j += 16) {
        __m256 e0 = exp_or_zero(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), m), t));
        __m256 e1 = exp_or_zero(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), m), t));
        _mm256_storeu_ps(out + j, e0);
        _mm256_storeu_ps(out + j + 8, e1);
        acc0 = add8_pd(acc0, e0);
        acc1 = add8_pd(acc1, e1);
    }
    for (; j < V; j += 8) {
        float in[8], e[8];
        for (int l = 0; l < 8; l++) in[l] = j + l < V ? x[j + l] : -INFINITY;
        __m256 v = exp_or_zero(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(in), m), t));
        _mm256_storeu_ps(e, v);
        for (int l = 0; l < 8 && j + l < V; l++) out[j + l] = e[l];
        acc0 = add8_pd(acc0, v);
    }
    double total = sum4(_mm256_add_pd(acc0, acc1));

    if (top_p < 1.0) {
        /* the candidates, heaped: the nucleus is taken from the top until the mass before a token reaches
           top_p of the total */
        float floor_ = (float)((1.0 - top_p) / (double)V * total);
        if (floor_ > 1.0f) floor_ = 1.0f;          /* the most likely token's e is 1: always ranked */
        long n = 0;
        const __m256 f = _mm256_set1_ps(floor_);
        cand *h = candidates(V);
        if (!h) return -1;
        for (j = 0; j + 8 <= V; j += 8) {
            int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(out + j), f, _CMP_GE_OQ));
            while (hit) {
                int l = __builtin_ctz(hit);
                hit &= hit - 1;
                h[n++] = (cand){out[j + l], (int32_t)(j + l)};
            }
        }
        for (; j < V; j++)
            if (out[j] >= floor_) h[n++] = (cand){out[j], (int32_t)j};
        for (long a = n / 2 - 1; a >= 0; a--) sift_down(h, n, a);
        double limit = top_p * total, mass = 0.0;
        long taken = 0;                             /* the nucleus ends up at h[n .. n + taken) */
        while (n > 0 && mass < limit) {
            cand top = h[0];
            h[0] = h[--n];
            sift_down(h, n, 0);
            mass += top.v;
            h[n] = top;
            taken++;
        }
        memset(out, 0, (size_t)V * sizeof(float));
        const float inv = (float)(1.0 / mass);
        for (long a = n; a < n + taken; a++) out[h[a].i] = h[a].v * inv;
        return 0;
    }
    const float inv = (float)(1.0 / total);
    const __m256 s = _mm256_set1_ps(inv);
    for (j = 0; j + 8 <= V; j += 8) _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(out + j), s));
    for (; j < V; j++) out[j] *= inv;
    return 0;
}

/* out (n rows of V) = each row of x warped (warp_row); returns 0, or warp_row's error */
int warp_rows(const float *x, long n, long V, double temperature, double top_p, float *out) {
    for (long r = 0; r < n; r++) {
        int bad = warp_row(x + r * V, V, temperature, top_p, out + r * V);
        if (bad) return bad;
    }
    return 0;
}

/* out[r] = the first token of row r of p (n rows of V probabilities, each row's sum need not be 1) whose
   cumulative sum reaches u[r] times the row's sum (u in (0, 1]), never a token of probability 0: an
   inverse-CDF draw. The sums run in float64 over blocks of 64 tokens (the row's sum is the blocks' in
   order, the search goes block by block, then token by token in the block it lands in); where rounding
   leaves the search short of u * sum at the row's end, the last token with a probability is taken. A row
   of zeros gives 0. */
#define BLOCK 64
static inline double block_sum(const float *row, long lo, long hi) {
    __m256d acc = _mm256_setzero_pd();
    long j = lo;
    for (; j + 8 <= hi; j += 8) acc = add8_pd(acc, _mm256_loadu_ps(row + j));
    double s = sum4(acc);
    for (; j < hi; j++) s += row[j];
    return s;
}

static long draw_row(const float *row, long V, double u) {
    long blocks = (V + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (long b = 0; b < blocks; b++) {
        long lo = b * BLOCK, hi = lo + BLOCK < V ? lo + BLOCK : V;
        total += block_sum(row, lo, hi);
    }
    double target = u * total, cum = 0.0;
    for (long b = 0; b < blocks; b++) {
        long lo = b * BLOCK, hi = lo + BLOCK < V ? lo + BLOCK : V;
        double s = block_sum(row, lo, hi);
        if (cum + s < target) { cum += s; continue; }
        for (long j = lo; j < hi; j++) {
            if (row[j] <= 0.0f) continue;
            cum += row[j];
            if (cum >= target) return j;
        }
    }
    for (long j = V - 1; j >= 0; j--)       /* short by rounding, or a row of zeros */
        if (row[j] > 0.0f) return j;
    return 0;
}

void draw_rows(const float *p, long n, long V, const double *u, int64_t *out) {
    for (long r = 0; r < n; r++) out[r] = draw_row(p + r * V, V, u[r]);
}

/* out[r] = draw_rows' token of row r of x warped (warp_rows), at u = 1 - rand01[r] (rand01 in [0, 1), as
   Sampler.sample makes u): Sampler.sample(Sampler.probs(x)) in one call, the same tokens, without the
   warped rows kept (a sampled step's token: the loop's Python operators around the two calls cost more
   than their work, between forwards whose weights have flushed the caches). Returns 0, -1 where a buffer
   could not be had, or warp_row's error. */
int sample_rows(const float *x, long n, long V, double temperature, double top_p, const double *rand01, int64_t *out) {
    float *warped = warp_buffer(V);
    if (!warped) return -1;
    for (long r = 0; r < n; r++) {
        int bad = warp_row(x + r * V, V, temperature, top_p, warped);
        if (bad) return bad;
        out[r] = draw_row(warped, V, 1.0 - rand01[r]);
    }
    return 0;
}

/* Speculative sampling's verification of k drafted tokens against k + 1 logits rows, on the CPU (Sampler.walk):
   row i is warped only when the walk reaches it; draft i is accepted where u[i] * q_i(draft) <= p_i(draft)
   (q: the draft's distributions, k rows of V, or NULL for deterministic drafts, a one-hot q); at the first
   rejection the target's token is drawn from max(0, p_i - q_i) (p_i without the draft where q is NULL), or
   from p_i where that is all 0; after k acceptances from p_k. The draw is draw_rows' at 1 - rand01.
   out[0] = drafts accepted, out[1] = the target's token after them. Returns 0; -1 where a buffer could not
   be had, -2 where a draft is not one of the V tokens, warp_row's -3 for a row without a finite largest
   value. The same comparisons, rows and draw as Sampler.judge_rows, in one call: a round's Python
   operators around each row's warp cost more than the warp itself between forwards. */
#define BAD_DRAFT (-2)
int walk_rows(const float *x, long k, long V, const int64_t *draft, const float *q, const float *u, double rand01,
              double temperature, double top_p, int64_t *out) {
    for (long i = 0; i < k; i++)
        if (draft[i] < 0 || draft[i] >= V) return BAD_DRAFT;
    float *p = warp_buffer(V);
    if (!p) return -1;
    for (long i = 0; i < k; i++) {
        int bad = warp_row(x + i * V, V, temperature, top_p, p);
        if (bad) return bad;
        long tok = draft[i];
        float q_tok = q ? q[i * V + tok] : 1.0f;
        if (!(u[i] * q_tok > p[tok])) continue;
        /* rejected: the target's token from the correction, where it has any mass, else from p */
        out[0] = i;
        int any = 0;
        if (q) {
            const float *qi = q + i * V;
            for (long j = 0; j < V && !any; j++) any = p[j] > qi[j];
            if (any)
                for (long j = 0; j < V; j++) p[j] = p[j] > qi[j] ? p[j] - qi[j] : 0.0f;
        } else {
            for (long j = 0; j < V && !any; j++) any = j != tok && p[j] > 0.0f;
            if (any) p[tok] = 0.0f;
        }
        out[1] = draw_row(p, V, 1.0 - rand01);
        return 0;
    }
    int bad = warp_row(x + k * V, V, temperature, top_p, p);
    if (bad) return bad;
    out[0] = k;
    out[1] = draw_row(p, V, 1.0 - rand01);
    return 0;
}
