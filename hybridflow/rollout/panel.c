/* y[M, N] = x[M, K] W^T (+ b) in fp32 with W laid out in panels of 16 output columns: wp[N / 16][K][16].
 *
 * Built and loaded by hybridflow/rollout/panel.py (gcc -O3 -mavx2 -mfma -fopenmp). Each thread takes a run of
 * whole panels, so it reads the weights front to back; a block of up to 6 rows of x is multiplied against a
 * panel with 12 accumulators held in registers (6 rows x 2 vectors of 8 columns), and the panel's next KiB is
 * prefetched. At decode sizes (8-64 rows) the product is bound by how fast the weights stream from memory,
 * which is where oneDNN's blocked product falls short on an AVX2 CPU (bench/decode_weights.py). */
#include <immintrin.h>

#define PREFETCH_KS 16 /* 16 k-steps of 64 bytes: 1 KiB ahead */

#define ROW(r) \
    if (R > r) { \
        __m256 xb = _mm256_broadcast_ss(x + r * ldx + k); \
        a##r = _mm256_fmadd_ps(xb, w0, a##r); \
        b##r = _mm256_fmadd_ps(xb, w1, b##r); \
    }
#define OUT(r) \
    if (R > r) { \
        _mm256_storeu_ps(y + r * ldy, a##r); \
        _mm256_storeu_ps(y + r * ldy + 8, b##r); \
    }
/* accumulators are named variables, not arrays: gcc spills arrays to the stack on every k-step */
#define BLOCK(R_) \
    static void block##R_(const float* x, long ldx, const float* wp, long K, const float* bias, float* y, long ldy) { \
        enum { R = R_ }; \
        __m256 a0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps(); \
        __m256 b0 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps(); \
        __m256 a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, b1 = b0, b2 = b0, b3 = b0, b4 = b0, b5 = b0; \
        for (long k = 0; k < K; ++k) { \
            _mm_prefetch((const char*)(wp + (k + PREFETCH_KS) * 16), _MM_HINT_T0); \
            __m256 w0 = _mm256_loadu_ps(wp + k * 16), w1 = _mm256_loadu_ps(wp + k * 16 + 8); \
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) \
        } \
        OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5) \
    }
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)

typedef void (*block_fn)(const float*, long, const float*, long, const float*, float*, long);
static const block_fn BLOCKS[7] = {0, block1, block2, block3, block4, block5, block6};

void hf_panel_linear(const float* x, long M, const float* wp, const float* bias, long N, long K, float* y,
                     int threads) {
    long panels = N / 16;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long p = 0; p < panels; ++p) {
        const float* w = wp + p * K * 16;
        const float* b = bias ? bias + p * 16 : 0;
        float* yp = y + p * 16;
        long m = 0;
        /* blocks of 6 rows; the last 7-8 rows as 4 + 3-4, so no block is left with 1-2 rows */
        for (; M - m > 8 || M - m == 6; m += 6) block6(x + m * K, K, w, K, b, yp + m * N, N);
        if (M - m >= 7) {
            block4(x + m * K, K, w, K, b, yp + m * N, N);
            m += 4;
        }
        if (M > m) BLOCKS[M - m](x + m * K, K, w, K, b, yp + m * N, N);
    }
}
