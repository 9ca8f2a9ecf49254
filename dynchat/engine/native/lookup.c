/* Lookup's search (engine/lookup.py), the same results as its numpy code, in a few calls.

   Why: a search runs between two target forwards, whose weights (~100 MB) have evicted the caches;
   there numpy's per-call work and the interpreter's own code cost ~0.5 ms a round on a 2-core CPU,
   a tenth of a step, against a few dozen microseconds of actual searching. The Python code stays
   the reference and the fallback where the library is not built; tests check both agree. Built
   with -ffp-contract=off, so the estimates are the same doubles the Python code computes. */
#include <stdint.h>
#include <stdlib.h>

#define SEP (-1)

/* Earlier occurrences in text[0 .. limit) of the longest tail of `tail` (tail_n tokens, the newest
   last; at most cap <= tail_n tokens matched): the positions right after them (ascending) into out,
   their count returned, the match length into *match (0 when there is none). As lookup.scan_match
   over text followed by tail: every end whose token equals the newest one starts at length 1; the
   length grows while some end still matches. */
static long scan_tail(const int32_t *text, long limit, const int32_t *tail, long tail_n, int cap, int64_t *out,
                      int *match) {
    if (cap < 1) cap = 1;
    const int32_t last = tail[tail_n - 1];
    int best = 0;
    long count = 0;
    for (long i = 0; i < limit; i++) {
        if (text[i] != last) continue;
        int l = 1;
        while (l < cap && i - l >= 0 && text[i - l] == tail[tail_n - 1 - l]) l++;
        if (l > best) { best = l; count = 0; }
        if (l == best) out[count++] = i + 1;
    }
    *match = best;
    return count;
}

/* The same within one sequence: seq's own tail (n tokens) in seq[0 .. limit) */
long lookup_scan(const int32_t *seq, long n, long limit, int cap, int64_t *out, int *match) {
    *match = 0;
    if (n < 2 || limit < 1) return 0;
    return scan_tail(seq, limit, seq, n, cap, out, match);
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

/* Candidate.expected: the sum over i of the product of the first i estimates (the same doubles) */
static double expected(const double *probs, int made) {
    double total = 0.0, chain = 1.0;
    for (int i = 0; i < made; i++) {
        chain *= probs[i];
        total += chain;
    }
    return total;
}

/* lookup.draft_limit */
static int draft_limit(int match, int max_draft, double match_factor) {
    int lim = (int)(match_factor * (double)match);
    if (lim < 1) lim = 1;
    return lim < max_draft ? lim : max_draft;
}

/* lookup.evenly_spaced applied: count of the n starts, evenly spaced, in place (n > count > 1) */
static long evenly(int64_t *starts, long n, long count) {
    double step = (double)(n - 1) / (double)(count - 1);
    for (long i = 0; i < count - 1; i++) starts[i] = starts[(int64_t)((double)i * step)];   /* index >= i */
    starts[count - 1] = starts[n - 1];
    return count;
}

/* Keep a found continuation in (tokens, probs) when it expects strictly more than the one held */
static int keep_better(int32_t *tokens, double *probs, int made, const int32_t *t2, const double *p2, int made2) {
    if (expected(p2, made2) <= expected(probs, made)) return made;
    for (int i = 0; i < made2; i++) { tokens[i] = t2[i]; probs[i] = p2[i]; }
    return made2;
}

/* LookupDrafter.candidate in one call: the conversation's own continuation, the index's (suffix array
   over the reversed replies; size 0: none) and the recent replies' (scanned; recent NULL: none), the
   one that expects the most accepted tokens (ties: the conversation's, then the index's). icfg:
   max_match, min_match, conversation_min_match, max_occurrences, max_draft; dcfg: match_factor,
   prior, shrink_conversation, shrink_replies, replies_later_scale, min_confidence (LookupConfig).
   tokens_out and probs_out hold max_draft; the count is returned (-1: out of memory). */
int lookup_candidate(const int32_t *seq, long n, const int32_t *corpus, long corpus_size, long text_n,
                     const int32_t *rev, const int32_t *sa, long sa_size, const int32_t *recent, long recent_size,
                     const int32_t *icfg, const double *dcfg, int32_t *tokens_out, double *probs_out) {
    const int max_match = icfg[0], min_match = icfg[1], conv_min = icfg[2], max_occ = icfg[3], max_draft = icfg[4];
    const double factor = dcfg[0], prior = dcfg[1], shrink_conv = dcfg[2], shrink_rep = dcfg[3], later = dcfg[4],
                 min_conf = dcfg[5];
    long room = n > recent_size ? n : recent_size;
    int64_t *starts = malloc(sizeof(int64_t) * (room > 1 ? room : 1));
    int32_t *tok2 = malloc(sizeof(int32_t) * max_draft);
    double *prob2 = malloc(sizeof(double) * max_draft);
    if (!starts || !tok2 || !prob2) { free(starts); free(tok2); free(prob2); return -1; }
    int made = 0, match = 0;
    long count = lookup_scan(seq, n, n - 1, max_match < n - 1 ? max_match : (int)(n - 1), starts, &match);
    if (match >= conv_min && count > 0) {
        long first = count > max_occ ? count - max_occ : 0;
        made = lookup_follow(seq, n, starts + first, count - first, draft_limit(match, max_draft, factor), match,
                             prior, min_match, shrink_conv, 1.0, min_conf, tokens_out, probs_out);
    }
    const long tail_n = n < max_match ? n : max_match;       /* seq[-max_match:] */
    const int32_t *tail = seq + n - tail_n;
    int best_made = 0;                                       /* the replies' best: index, then recent */
    if (sa_size > 0 && tail_n > 0) {
        int32_t tail_rev[64];
        int len = (int)(tail_n < 64 ? tail_n : 64);
        for (int j = 0; j < len; j++) tail_rev[j] = tail[tail_n - 1 - j];
        long lo, hi;
        int m = lookup_narrow(rev, sa, sa_size, tail_rev, len, &lo, &hi);
        if (m >= min_match && hi > lo) {
            long c = hi - lo;
            int64_t *idx = malloc(sizeof(int64_t) * c);
            if (idx) {
                for (long i = 0; i < c; i++) idx[i] = text_n - (int64_t)sa[lo + i];
                if (c > max_occ) c = evenly(idx, c, max_occ);
                best_made = lookup_follow(corpus, corpus_size, idx, c, draft_limit(m, max_draft, factor), m, prior,
                                          min_match, shrink_rep, later, min_conf, tok2, prob2);
                free(idx);
            }
        }
    }
    if (recent != NULL && tail_n > 0 && recent_size + tail_n >= 2 && recent_size >= 1) {
        int m = 0;
        int cap = max_match < tail_n ? max_match : (int)tail_n;
        long c = scan_tail(recent, recent_size, tail, tail_n, cap, starts, &m);
        if (m >= min_match && c > 0) {
            if (c > max_occ) c = evenly(starts, c, max_occ);
            int32_t t3[64];
            double p3[64];
            int lim = draft_limit(m, max_draft, factor);
            int made3 = lookup_follow(recent, recent_size, starts, c, lim < 64 ? lim : 64, m, prior, min_match,
                                      shrink_rep, later, min_conf, t3, p3);
            best_made = keep_better(tok2, prob2, best_made, t3, p3, made3);
        }
    }
    made = keep_better(tokens_out, probs_out, made, tok2, prob2, best_made);
    free(starts); free(tok2); free(prob2);
    return made;
}
