/* Lookup's search (engine/lookup.py), the same results as its numpy code, in a few calls.

   Why: a search runs between two target forwards, whose weights (~100 MB) have evicted the caches;
   there numpy's per-call work and the interpreter's own code cost ~0.5 ms a round on a 2-core CPU,
   a tenth of a step, against a few dozen microseconds of actual searching. The Python code stays
   the reference and the fallback where the library is not built; tests check both agree. Built
   with -ffp-contract=off, so the estimates are the same doubles the Python code computes. */
#include <stdint.h>
#include <stdlib.h>

#define SEP (-1)

/* Earlier occurrences of the longest tail of seq (n tokens; at most cap tokens matched) that end
   before index limit: the positions right after them (ascending) into out, their count returned,
   the match length into *match (0 when there is none). As lookup.scan_match: every end whose token
   equals the last one starts at length 1; the length grows while some end still matches. */
long lookup_scan(const int32_t *seq, long n, long limit, int cap, int64_t *out, int *match) {
    *match = 0;
    if (n < 2 || limit < 1) return 0;
    if (cap < 1) cap = 1;
    const int32_t last = seq[n - 1];
    int best = 0;
    long count = 0;
    for (long i = 0; i < limit; i++) {
        if (seq[i] != last) continue;
        int l = 1;
        while (l < cap && i - l >= 0 && seq[i - l] == seq[n - 1 - l]) l++;
        if (l > best) { best = l; count = 0; }
        if (l == best) out[count++] = i + 1;
    }
    *match = best;
    return count;
}

/* The range [*lo, *hi) of the suffix array sa (over the reversed corpus rev) whose suffixes begin
   with tail read backwards (tail_rev[0] the newest token), narrowed one token at a time while it
   stays non-empty: the match length returned. As ReplyIndex._indexed. */
int lookup_narrow(const int32_t *rev, const int32_t *sa, long size, const int32_t *tail_rev, int len,
                  long *lo_out, long *hi_out) {
    long lo = 0, hi = size;
    int match = 0;
    for (int j = 0; j < len; j++) {
        const int32_t tok = tail_rev[j];
        long a = lo, b = hi;                 /* first index whose key >= tok */
        while (a < b) {
            long m = a + (b - a) / 2;
            if (rev[(long)sa[m] + j] < tok) a = m + 1; else b = m;
        }
        long new_lo = a;
        b = hi;                              /* first index whose key > tok */
        while (a < b) {
            long m = a + (b - a) / 2;
            if (rev[(long)sa[m] + j] <= tok) a = m + 1; else b = m;
        }
        if (new_lo >= a) break;
        lo = new_lo; hi = a; match = j + 1;
    }
    *lo_out = lo; *hi_out = hi;
    return match;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The most frequent path through the continuations of corpus (size tokens) at each of n starts, at
   most limit tokens: tokens and estimates into tokens_out / probs_out, their number returned. As
   lookup.follow over lookup._gather's rows: a continuation ends at SEP or the corpus's end; each
   token's estimate is count / (rows still on the path + prior * min_match / (match + d)), scaled by
   match / (match + shrink) for the first, later_scale after; the path stops when the product of
   the estimates falls below min_confidence. Ties go to the smallest token. */
int lookup_follow(const int32_t *corpus, long size, const int64_t *starts, long n, int limit, int match,
                  double prior, int min_match, double shrink, double later_scale, double min_confidence,
                  int32_t *tokens_out, double *probs_out) {
    if (n <= 0) return 0;
    int64_t *alive = malloc(sizeof(int64_t) * n);
    int32_t *col = malloc(sizeof(int32_t) * n);
    if (!alive || !col) { free(alive); free(col); return 0; }
    for (long i = 0; i < n; i++) alive[i] = starts[i];
    long n_alive = n;
    double chain = 1.0;
    int made = 0;
    for (int d = 0; d < limit; d++) {
        long c = 0;
        for (long i = 0; i < n_alive; i++) {
            int64_t pos = alive[i] + d;
            int32_t t = pos < size ? corpus[pos] : SEP;
            if (t != SEP) col[c++] = t;
        }
        if (c == 0) break;
        int32_t tok = col[0];
        long count = c;
        int same = 1;
        for (long i = 1; i < c; i++) if (col[i] != tok) { same = 0; break; }
        if (!same) {
            qsort(col, c, sizeof(int32_t), cmp_i32);
            count = 0;
            for (long i = 0; i < c;) {
                long j = i;
                while (j < c && col[j] == col[i]) j++;
                if (j - i > count) { count = j - i; tok = col[i]; }     /* strictly more: the smallest wins ties */
                i = j;
            }
        }
        double p = (double)count / ((double)n_alive + prior * (double)min_match / (double)(match + d));
        p *= d == 0 ? (double)match / ((double)match + shrink) : later_scale;
        chain *= p;
        if (chain < min_confidence) break;
        tokens_out[made] = tok;
        probs_out[made] = p;
        made++;
        if (count < n_alive) {
            long k = 0;
            for (long i = 0; i < n_alive; i++) {
                int64_t pos = alive[i] + d;
                if (pos < size && corpus[pos] == tok) alive[k++] = alive[i];
            }
            n_alive = k;
        }
    }
    free(alive);
    free(col);
    return made;
}
