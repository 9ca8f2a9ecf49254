/* Work items split over the threads so that none waits at the end while another has work left.

   Each thread starts with an equal contiguous share (what a static schedule gives it) and takes its
   items from the front, a few at a time; a thread that has finished its share takes the back half of
   what is left of another's and goes on with that as its own. Every thread so reads the weights in
   one sequential stream, which its prefetch runs ahead of (handing items out one by one as threads
   come free broke those streams and ran slower), and the two ends meet where the threads' speeds put
   them. Why: two cores' speeds differ by a few percent from moment to moment, and at the end of each
   of a step's ~120 matrices the faster waited for the slower: with a static split a SmolLM2 step
   waited 3-5% of its time so (2-core AMD EPYC, int4 tiles). Which thread computes an item changes
   nothing in it: the results are the same bits. */
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>

typedef struct {
    _Alignas(64) _Atomic uint64_t span;      /* front (low 32 bits) .. back (high 32 bits) */
} share;

static inline uint64_t pack(uint32_t front, uint32_t back) { return (uint64_t)back << 32 | front; }

/* up to CHUNK items from the front of s into *front (how many: 0 where s is empty); a few at a time,
   so that a step's small items (a head's group of 16 outputs: ~700 cycles) do not pay a locked
   instruction each */
#define CHUNK 4
static inline uint32_t take_front(share *s, uint32_t *front) {
    uint64_t v = atomic_load_explicit(&s->span, memory_order_relaxed);
    for (;;) {
        uint32_t f = (uint32_t)v, b = (uint32_t)(v >> 32);
        if (f >= b) return 0;
        uint32_t k = b - f < CHUNK ? b - f : CHUNK;
        if (atomic_compare_exchange_weak_explicit(&s->span, &v, pack(f + k, b), memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *front = f;
            return k;
        }
    }
}

/* the back half of what s has left (at least one item) into *front, *back; 0 where s is empty */
static inline int take_back_half(share *s, uint32_t *front, uint32_t *back) {
    uint64_t v = atomic_load_explicit(&s->span, memory_order_relaxed);
    for (;;) {
        uint32_t f = (uint32_t)v, b = (uint32_t)(v >> 32);
        if (f >= b) return 0;
        uint32_t mid = f + (b - f) / 2;
        if (atomic_compare_exchange_weak_explicit(&s->span, &v, pack(f, mid), memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *front = mid;
            *back = b;
            return 1;
        }
    }
}

/* fn(ctx, i) for every i in 0 .. n, each once, over a new team of omp_get_max_threads() threads (at most n;
   one: here, in order). Called from inside a parallel region, the nested team is this thread alone. */
void run_shared(long n, void (*fn)(void *, long), void *ctx) {
    int threads = omp_get_max_threads();
    if (threads > n) threads = (int)n;
    if (threads <= 1) {
        for (long i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    share shares[threads];
    for (int t = 0; t < threads; t++)
        atomic_init(&shares[t].span, pack((uint32_t)(n * t / threads), (uint32_t)(n * (t + 1) / threads)));
    #pragma omp parallel num_threads(threads)
    {
        int me = omp_get_thread_num();
        for (;;) {
            uint32_t at, k;
            while ((k = take_front(&shares[me], &at)))
                for (uint32_t i = at; i < at + k; i++) fn(ctx, i);
            /* own share done: the back half of the thread with the most left */
            int from = -1;
            uint32_t most = 0;
            for (int t = 0; t < threads; t++) {
                uint64_t v = atomic_load_explicit(&shares[t].span, memory_order_relaxed);
                uint32_t f = (uint32_t)v, b = (uint32_t)(v >> 32);
                if (t != me && b > f && b - f > most) {
                    most = b - f;
                    from = t;
                }
            }
            uint32_t f, b;
            if (from < 0 || !take_back_half(&shares[from], &f, &b)) {
                if (from < 0) break;
                continue;                    /* it emptied meanwhile: look again */
            }
            atomic_store_explicit(&shares[me].span, pack(f, b), memory_order_relaxed);
        }
    }
}
