/* The index of each row's largest value, as torch.argmax gives it (the first one on ties; the first
   NaN where a row has one), for greedy decoding's logits.

   Why: torch.argmax over a 49152-token vocabulary took ~28 us a row on a 2-core EPYC, and three times
   that between the forwards of the decoding loop, whose caches the weights have just flushed: ~3% of
   a verify of three tokens on SmolLM2. Here a row is two vector passes over 196 KB: its maximum,
   then where it first occurs. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static long first_nan(const float *row, long V) {
    for (long i = 0; i < V; i++)
        if (row[i] != row[i]) return i;
    return -1;
}

/* the row's largest value (NaN aside), and in *has_nan whether it holds a NaN; shared with sampling.c */
float row_max(const float *row, long V, int *has_nan) {
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= V; i += 8) {
        __m256 v = _mm256_loadu_ps(row + i);
        best = _mm256_max_ps(best, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, best);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    *has_nan = _mm256_movemask_ps(nan) != 0;
    for (long j = i; j < V; j++) {
        if (row[j] != row[j]) *has_nan = 1;
        else if (row[j] > m) m = row[j];
    }
    return m;
}

/* shared with decoder_layer.c's draft step */
long row_argmax(const float *row, long V) {
    int has_nan;
    float m = row_max(row, V, &has_nan);
    if (has_nan) return first_nan(row, V);
    long i;
    __m256 target = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= V; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < V; i++)
        if (row[i] == m) return i;
    return 0;              /* a row of -inf only: torch gives 0 as well */
}

/* out[r] = argmax of row r of x (n rows of V floats, contiguous) */
void argmax_rows(const float *x, long n, long V, int64_t *out) {
    for (long r = 0; r < n; r++) out[r] = row_argmax(x + r * V, V);
}

/* Greedy verification of k drafts against k + 1 logits rows: out[1 + r] = argmax of row r, out[0] = how
   many leading drafts equal the target's own tokens. */
void greedy_judge(const float *x, long k, long V, const int64_t *draft, int64_t *out) {
    long accepted = -1;
    for (long r = 0; r <= k; r++) {
        out[1 + r] = row_argmax(x + r * V, V);
        if (accepted < 0 && (r == k || out[1 + r] != draft[r])) accepted = r;
    }
    out[0] = accepted;
}
