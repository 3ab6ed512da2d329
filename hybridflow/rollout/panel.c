/* y[M, N] = x[M, K] W^T (+ b) in fp32 with W laid out in panels of 16 output columns: wp[N / 16][K][16], in
 * fp32 (hf_panel_linear) or bf16 (hf_panel_linear_bf16: widened to fp32 as loaded, half the bytes to read).
 *
 * Built and loaded by hybridflow/rollout/panel.py (gcc -O3 -mavx2 -mfma -fopenmp). Each thread takes a run of
 * whole panels, so it reads the weights front to back; a block of up to 6 rows of x is multiplied against a
 * panel with 12 accumulators held in registers (6 rows x 2 vectors of 8 columns), and the panel's next KiB is
 * prefetched. At decode sizes (8-64 rows) the product is bound by how fast the weights stream from memory,
 * which is where oneDNN's blocked product falls short on an AVX2 CPU (bench/decode_weights.py). */
#include <immintrin.h>

#include <stdint.h>

#define PREFETCH_BYTES 1024

static inline __m256 load_f32(const float* w) { return _mm256_loadu_ps(w); }
/* bf16 is the top half of an fp32: widen each 16-bit word and shift it up */
static inline __m256 load_bf16(const uint16_t* w) {
    __m128i h = _mm_loadu_si128((const __m128i*)w);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

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
#define BLOCK(R_, T, LOAD) \
    static void block##R_##LOAD(const float* x, long ldx, const T* wp, long K, const float* bias, float* y, \
                                long ldy) { \
        enum { R = R_ }; \
        __m256 a0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps(); \
        __m256 b0 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps(); \
        __m256 a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, b1 = b0, b2 = b0, b3 = b0, b4 = b0, b5 = b0; \
        for (long k = 0; k < K; ++k) { \
            _mm_prefetch((const char*)(wp + k * 16) + PREFETCH_BYTES, _MM_HINT_T0); \
            __m256 w0 = LOAD(wp + k * 16), w1 = LOAD(wp + k * 16 + 8); \
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) \
        } \
        OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5) \
    }
#define KERNEL(NAME, T, LOAD) \
    BLOCK(1, T, LOAD) BLOCK(2, T, LOAD) BLOCK(3, T, LOAD) BLOCK(4, T, LOAD) BLOCK(5, T, LOAD) BLOCK(6, T, LOAD) \
    void NAME(const float* x, long M, const T* wp, const float* bias, long N, long K, float* y, int threads) { \
        void (*const blocks[7])(const float*, long, const T*, long, const float*, float*, long) = { \
            0, block1##LOAD, block2##LOAD, block3##LOAD, block4##LOAD, block5##LOAD, block6##LOAD}; \
        long panels = N / 16; \
        _Pragma("omp parallel for schedule(static) num_threads(threads)") \
        for (long p = 0; p < panels; ++p) { \
            const T* w = wp + p * K * 16; \
            const float* b = bias ? bias + p * 16 : 0; \
            float* yp = y + p * 16; \
            long m = 0; \
            /* blocks of 6 rows; the last 7-8 rows as 4 + 3-4, so no block is left with 1-2 rows */ \
            for (; M - m > 8 || M - m == 6; m += 6) blocks[6](x + m * K, K, w, K, b, yp + m * N, N); \
            if (M - m >= 7) { \
                blocks[4](x + m * K, K, w, K, b, yp + m * N, N); \
                m += 4; \
            } \
            if (M > m) blocks[M - m](x + m * K, K, w, K, b, yp + m * N, N); \
        } \
    }

KERNEL(hf_panel_linear, float, load_f32)
KERNEL(hf_panel_linear_bf16, uint16_t, load_bf16)
