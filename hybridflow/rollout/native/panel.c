/* y[M, N] = x[M, K] W^T (+ b) in fp32 with W laid out in panels of 16 output columns: wp[N / 16][K][16], in
 * fp32 (hf_panel_linear) or bf16 (hf_panel_linear_bf16: widened to fp32 as loaded, half the bytes to read); with
 * AVX512-BF16, bf16 products on bf16 panels of column pairs (hf_panel_linear_dot, below).
 *
 * Built and loaded by hybridflow/rollout/native/panel.py (gcc -O3 -mavx2 -mfma -fopenmp; -mavx512f adds the AVX-512
 * products below). Each thread takes a run of whole panels, so it reads the weights front to back; a block of up
 * to 6 rows of x is multiplied against a panel with 12 accumulators held in registers (6 rows x 2 vectors of 8
 * columns), and the panel's next KiB is prefetched. At decode sizes (8-64 rows) the product is bound by how fast
 * the weights stream from memory, which is where oneDNN's blocked product falls short on an AVX2 CPU
 * (bench/decode_weights.py). */
#include <immintrin.h>

#include <stdint.h>
#include <stdlib.h>

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

#ifdef __AVX512F__
/* With AVX-512 (panel.py builds with -mavx512f where torch's CPU capability is AVX512) a panel's 16 columns are
 * one vector: a block takes up to 12 rows, one accumulator each, so each weight load feeds 12 FMAs of twice the
 * width. The rows are split into equal blocks (32 rows: 11 + 11 + 10), so no block is left with a few rows. */
static inline __m512 load16_f32(const float* w) { return _mm512_loadu_ps(w); }
static inline __m512 load16_bf16(const uint16_t* w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)w)), 16));
}
#define ROW16(r) \
    if (R > r) a##r = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, a##r);
#define OUT16(r) \
    if (R > r) _mm512_storeu_ps(y + r * ldy, a##r);
/* twelve row accumulators of one panel, each starting at the panel's bias (or 0) */
#define ACC16_FROM(bias) \
    __m512 a0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps(); \
    __m512 a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
#define BLOCK16(R_, T, LOAD) \
    static void block16_##R_##LOAD(const float* x, long ldx, const T* wp, long K, const float* bias, float* y, \
                                   long ldy) { \
        enum { R = R_ }; \
        ACC16_FROM(bias) \
        for (long k = 0; k < K; ++k) { \
            _mm_prefetch((const char*)(wp + k * 16) + PREFETCH_BYTES, _MM_HINT_T0); \
            __m512 w = LOAD(wp + k * 16); \
            ROW16(0) ROW16(1) ROW16(2) ROW16(3) ROW16(4) ROW16(5) ROW16(6) ROW16(7) ROW16(8) ROW16(9) ROW16(10) \
            ROW16(11) \
        } \
        OUT16(0) OUT16(1) OUT16(2) OUT16(3) OUT16(4) OUT16(5) OUT16(6) OUT16(7) OUT16(8) OUT16(9) OUT16(10) OUT16(11) \
    }
/* each thread takes a run of whole panels (wp: K * 16 weights each) and multiplies it with the M rows of x (L
 * elements apart, a block looping over L of them) in near-equal blocks of at most 12 rows */
#define SPLIT16(blocks, x, L, wp, K, bias, N, M, y, threads) \
    long panels = N / 16, nblocks = (M + 11) / 12; \
    _Pragma("omp parallel for schedule(static) num_threads(threads)") \
    for (long p = 0; p < panels; ++p) { \
        const float* b = bias ? bias + p * 16 : 0; \
        for (long i = 0, m = 0; i < nblocks; ++i) { \
            long r = M / nblocks + (i < M % nblocks); \
            blocks[r](x + m * L, L, wp + p * K * 16, L, b, y + m * N + p * 16, N); \
            m += r; \
        } \
    }
#define KERNEL16(NAME, T, LOAD) \
    BLOCK16(1, T, LOAD) BLOCK16(2, T, LOAD) BLOCK16(3, T, LOAD) BLOCK16(4, T, LOAD) BLOCK16(5, T, LOAD) \
    BLOCK16(6, T, LOAD) BLOCK16(7, T, LOAD) BLOCK16(8, T, LOAD) BLOCK16(9, T, LOAD) BLOCK16(10, T, LOAD) \
    BLOCK16(11, T, LOAD) BLOCK16(12, T, LOAD) \
    void NAME(const float* x, long M, const T* wp, const float* bias, long N, long K, float* y, int threads) { \
        void (*const blocks[13])(const float*, long, const T*, long, const float*, float*, long) = { \
            0, block16_1##LOAD, block16_2##LOAD, block16_3##LOAD, block16_4##LOAD, block16_5##LOAD, \
            block16_6##LOAD, block16_7##LOAD, block16_8##LOAD, block16_9##LOAD, block16_10##LOAD, \
            block16_11##LOAD, block16_12##LOAD}; \
        SPLIT16(blocks, x, K, wp, K, bias, N, M, y, threads) \
    }

KERNEL16(hf_panel_linear, float, load16_f32)
KERNEL16(hf_panel_linear_bf16, uint16_t, load16_bf16)

#ifdef __AVX512BF16__
/* bf16 products with fp32 sums (panel.py adds -mavx512bf16 where the CPU has avx512_bf16): the panels hold bf16
 * weights with each column's k and k + 1 side by side, wp[N / 16][K / 2][16][2], and x is rounded to bf16 pairs
 * once per call, so one vdpbf16ps adds two k-steps of 16 columns to a row's accumulator: half the instructions of
 * widening bf16 weights to fp32 FMAs, the same rounding as a bf16 model's own products (oneDNN's bf16 kernels run
 * this instruction). */
#define ROWDP(r) \
    if (R > r) a##r = _mm512_dpbf16_ps(a##r, (__m512bh)_mm512_set1_epi32((int)x[r * ldx + k]), w);
#define BLOCKDP(R_) \
    static void blockdp_##R_(const uint32_t* x, long ldx, const uint16_t* wp, long K2, const float* bias, float* y, \
                             long ldy) { \
        enum { R = R_ }; \
        ACC16_FROM(bias) \
        for (long k = 0; k < K2; ++k) { \
            _mm_prefetch((const char*)(wp + k * 32) + PREFETCH_BYTES, _MM_HINT_T0); \
            __m512bh w = (__m512bh)_mm512_loadu_si512(wp + k * 32); \
            ROWDP(0) ROWDP(1) ROWDP(2) ROWDP(3) ROWDP(4) ROWDP(5) ROWDP(6) ROWDP(7) ROWDP(8) ROWDP(9) ROWDP(10) \
            ROWDP(11) \
        } \
        OUT16(0) OUT16(1) OUT16(2) OUT16(3) OUT16(4) OUT16(5) OUT16(6) OUT16(7) OUT16(8) OUT16(9) OUT16(10) OUT16(11) \
    }
BLOCKDP(1) BLOCKDP(2) BLOCKDP(3) BLOCKDP(4) BLOCKDP(5) BLOCKDP(6) BLOCKDP(7) BLOCKDP(8) BLOCKDP(9) BLOCKDP(10)
BLOCKDP(11) BLOCKDP(12)

/* x[M][K] fp32 -> xp[M][K] bf16, rounded to nearest even (K even, so row r's pairs start at xp + r * K) */
static void to_bf16(const float* x, long n, uint16_t* xp) {
    long i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i*)(xp + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    for (; i < n; ++i) {
        union { float f; uint32_t u; } v = {x[i]};
        xp[i] = (uint16_t)(v.f != v.f ? (v.u >> 16) | 0x40 : (v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
    }
}

void hf_panel_linear_dot(const float* x, long M, const uint16_t* wp, const float* bias, long N, long K, float* y,
                         int threads) {
    void (*const blocks[13])(const uint32_t*, long, const uint16_t*, long, const float*, float*, long) = {
        0, blockdp_1, blockdp_2, blockdp_3, blockdp_4, blockdp_5, blockdp_6, blockdp_7, blockdp_8, blockdp_9,
        blockdp_10, blockdp_11, blockdp_12};
    uint16_t* xp = malloc(M * K * sizeof(uint16_t));
    to_bf16(x, M * K, xp);
    const uint32_t* x2 = (const uint32_t*)xp;
    long K2 = K / 2;
    SPLIT16(blocks, x2, K2, wp, K, bias, N, M, y, threads)
    free(xp);
}
#endif
#else
KERNEL(hf_panel_linear, float, load_f32)
KERNEL(hf_panel_linear_bf16, uint16_t, load_bf16)
#endif

/* wp[N / 16][K][16] = w[N][K] (row stride ldw) laid out in panels. Each thread takes whole panels; a panel is
 * written front to back from 8 x 8 tiles of its 16 rows transposed in registers, so the 16 source rows are read
 * as 16 forward streams and the panel is written once, in order (a strided element copy reads each source line
 * 16 times over). K must be a multiple of 8 (panel.py checks). */
static inline void transpose8(__m256* r) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

void hf_to_panels(const float* w, long N, long K, long ldw, float* wp, int threads) {
    long panels = N / 16;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long p = 0; p < panels; ++p) {
        const float* src = w + p * 16 * ldw;
        float* dst = wp + p * K * 16;
        for (long k = 0; k < K; k += 8) {
            __m256 lo[8], hi[8];
            for (int j = 0; j < 8; ++j) {
                lo[j] = _mm256_loadu_ps(src + j * ldw + k);
                hi[j] = _mm256_loadu_ps(src + (j + 8) * ldw + k);
            }
            transpose8(lo);
            transpose8(hi);
            for (int i = 0; i < 8; ++i) {
                _mm256_storeu_ps(dst + (k + i) * 16, lo[i]);
                _mm256_storeu_ps(dst + (k + i) * 16 + 8, hi[i]);
            }
        }
    }
}
