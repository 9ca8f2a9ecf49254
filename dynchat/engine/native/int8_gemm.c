/* int8 weight x float32 activation matmul for the int8 route on x86 CPUs with AVX2 and FMA.

   y[m][n] = scale[n] * sum_k x[m][k] * w[n][k];  x float32 (M, K), w int8 (N, K), K % 16 == 0.

   Why: PyTorch's CPU kernel for this (_weight_int8pack_mm) takes bfloat16 activations and, on
   CPUs without AVX-512, streams the weights at about half the memory's speed; llama.cpp's Q8_0
   decodes SmolLM2 over twice as fast. Here the weights are read once per group of up to four
   activation rows (a k-token verify reuses each weight load), converted to float32 in registers
   and multiplied in float32.

   Every (m, n) is summed in the same order (two 8-lane accumulators over k in steps of 16, then
   the lanes), whatever M is: a row's result does not depend on the other rows, so verifying k
   tokens in one call gives exactly what k single-token steps give. Threads: the caller's OpenMP
   runtime (PyTorch's libgomp, loaded first), over output rows. */
#include <immintrin.h>
#include <stdint.h>

static inline float lanes_sum(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

void int8_gemm(const float *x, const int8_t *w, const float *scale, float *y, int M, int N, int K) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t *wn = w + (long)n * K;
        for (int m0 = 0; m0 < M; m0 += 4) {
            int rows = M - m0 < 4 ? M - m0 : 4;
            __m256 acc[4][2];
            for (int i = 0; i < 4; i++) {
                acc[i][0] = _mm256_setzero_ps();
                acc[i][1] = _mm256_setzero_ps();
            }
            for (int k = 0; k < K; k += 16) {
                __m128i b = _mm_loadu_si128((const __m128i *)(wn + k));
                __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
                for (int i = 0; i < rows; i++) {
                    const float *xm = x + (long)(m0 + i) * K + k;
                    acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xm), w0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), w1, acc[i][1]);
                }
            }
            for (int i = 0; i < rows; i++)
                y[(long)(m0 + i) * N + n] = lanes_sum(_mm256_add_ps(acc[i][0], acc[i][1])) * scale[n];
        }
    }
}
