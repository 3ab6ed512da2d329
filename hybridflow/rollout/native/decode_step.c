/* One decode step of a Llama-style decoder (one new token per row) through all its layers in one call: RMSNorm,
 * fused q/k/v product, rotary, cache write, grouped attention over the cache, o product, residual, RMSNorm, fused
 * gate/up product, SiLU gate, down product, residual; the final norm last. The four products run on the panel
 * kernel (panel.c, linked into the same library); everything between them runs here in fp32.
 *
 * Eager torch runs ~25 ops a layer around the products, each a dispatch plus a pass over a few KiB: at 8 rows of
 * SmolLM2 that was ~30% of a decode step (bench/decode_profile.py). Called by rollout/native/decoder.py, which checks the
 * shapes (head_dim and hidden a multiple of 8) and falls back to its torch path elsewhere. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

void hf_panel_linear(const float* x, long M, const float* wp, const float* bias, long N, long K, float* y, int threads);
void hf_panel_linear_bf16(const float* x, long M, const uint16_t* wp, const float* bias, long N, long K, float* y,
                          int threads);
void hf_panel_linear_dot(const float* x, long M, const uint16_t* wp, const float* bias, long N, long K, float* y,
                         int threads);

/* per layer, in this order, in the pointer table the caller passes */
enum { LN1, QKV, QKV_BIAS, O, O_BIAS, LN2, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, PER_LAYER };

/* the panels' kind, as fused_step.py passes it */
enum { FP32_PANELS, BF16_PANELS, BF16_DOT_PANELS };

static void linear(int kind, const float* x, long M, const void* wp, const void* bias, long N, long K, float* y,
                   int threads) {
#ifdef __AVX512BF16__
    if (kind == BF16_DOT_PANELS) {
        hf_panel_linear_dot(x, M, (const uint16_t*)wp, (const float*)bias, N, K, y, threads);
        return;
    }
#endif
    if (kind == BF16_PANELS)
        hf_panel_linear_bf16(x, M, (const uint16_t*)wp, (const float*)bias, N, K, y, threads);
    else
        hf_panel_linear(x, M, (const float*)wp, (const float*)bias, N, K, y, threads);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* e^x to ~2 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n through the exponent bits */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* out[b] = (h[b] (+ delta[b], written back to h)) * rsqrt(mean(h[b]^2) + eps) * w; H a multiple of 8 */
static void add_rms_norm(float* h, const float* delta, const float* w, float* out, long B, long H, float eps) {
    for (long b = 0; b < B; ++b) {
        float* hb = h + b * H;
        __m256 ss = _mm256_setzero_ps();
        for (long j = 0; j < H; j += 8) {
            __m256 v = _mm256_loadu_ps(hb + j);
            if (delta) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(delta + b * H + j));
                _mm256_storeu_ps(hb + j, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(ss) / (float)H + eps));
        for (long j = 0; j < H; j += 8)
            _mm256_storeu_ps(out + b * H + j,
                             _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(hb + j), r), _mm256_loadu_ps(w + j)));
    }
}

/* rotate one head in place: x[j] cos[j] + x[j +- D/2] sin[j] (sin carries rotate_half's sign for j < D/2) */
static void rotary(float* x, const float* cos, const float* sin, long D) {
    long half = D / 2;
    for (long j = 0; j < half; ++j) {
        float a = x[j], b = x[j + half];
        x[j] = a * cos[j] + b * sin[j];
        x[j + half] = b * cos[j + half] + a * sin[j + half];
    }
}

/* G query heads [G][D] of one row against its kv head's cache k, v [T][D] over the slots [0, width) that `mask`
 * allows; out [G][D]. Scores, softmax (fp32) and the weighted sum as eager attention computes them. */
static void attend(const float* q, long G, const float* k, const float* v, const uint8_t* mask, long width, long D,
                   float scale, float* out) {
    long padded = (width + 7) & ~7L;
    float s[G * padded];
    for (long g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float* sg = s + g * padded;
        float top = -INFINITY;
        for (long t = 0; t < padded; ++t) {
            sg[t] = -INFINITY;
            if (t >= width || !mask[t]) continue;
            __m256 acc = _mm256_setzero_ps();
            for (long j = 0; j < D; j += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j), _mm256_loadu_ps(k + t * D + j), acc);
            sg[t] = hsum(acc) * scale;
            top = sg[t] > top ? sg[t] : top;
        }
        /* masked slots (-inf) get weight 0, not exp8's clamped e^-87 */
        __m256 sum = _mm256_setzero_ps(), ninf = _mm256_set1_ps(-INFINITY), vtop = _mm256_set1_ps(top);
        for (long t = 0; t < padded; t += 8) {
            __m256 st = _mm256_loadu_ps(sg + t);
            __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(st, ninf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(st, vtop)));
            _mm256_storeu_ps(sg + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        float inv = 1.0f / hsum(sum);
        float* og = out + g * D;
        for (long j = 0; j < D; j += 8) _mm256_storeu_ps(og + j, _mm256_setzero_ps());
        for (long t = 0; t < width; ++t) {
            if (!mask[t]) continue;
            __m256 p = _mm256_set1_ps(sg[t] * inv);
            for (long j = 0; j < D; j += 8)
                _mm256_storeu_ps(og + j, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + t * D + j), _mm256_loadu_ps(og + j)));
        }
    }
}

/* silu(gate) * up for gu [B][2I] (gate first) into act [B][I]; I a multiple of 8 */
static void silu_mul(const float* gu, float* act, long B, long I) {
    __m256 one = _mm256_set1_ps(1.0f);
    for (long b = 0; b < B; ++b)
        for (long j = 0; j < I; j += 8) {
            __m256 g = _mm256_loadu_ps(gu + b * 2 * I + j), u = _mm256_loadu_ps(gu + b * 2 * I + I + j);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            _mm256_storeu_ps(act + b * I + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
        }
}

/* h [B][H]: the new tokens' embeddings in, the last layer's residual stream out; x [B][H]: the final norm of it.
 * Caches [layers][S][Hkv][T][D] of S sequences, B of which step here: row b is sequence slots[b] and writes its key
 * and value at column cols[b] (sequences may be of different lengths, and the others are left as they are);
 * key_mask [S][T] (column cols[b] of each stepping sequence already set); cos/sin tables [positions][D];
 * pos [B]: each row's rotary position. scratch: B * ((Hq + 2 Hkv) D + Hq D + H + 3 I) floats. */
void hf_decode_step(const void* const* w, long layers, int kind, float* h, float* x, long B, long H, long Hq,
                    long Hkv, long D, long I, float* k_cache, float* v_cache, long S, long T, const uint8_t* key_mask,
                    const long* slots, const long* cols, const float* cos, const float* sin, const long* pos, const float* final_norm,
                    float eps, float scale, float* scratch, int threads) {
    long QKV_N = (Hq + 2 * Hkv) * D, G = Hq / Hkv;
    float *qkv = scratch, *attn = qkv + B * QKV_N, *delta = attn + B * Hq * D, *gu = delta + B * H, *act = gu + B * 2 * I;
    add_rms_norm(h, 0, (const float*)w[LN1], x, B, H, eps);
    for (long i = 0; i < layers; ++i) {
        const void* const* lw = w + i * PER_LAYER;
        linear(kind, x, B, lw[QKV], lw[QKV_BIAS], QKV_N, H, qkv, threads);
        float *kc = k_cache + i * S * Hkv * T * D, *vc = v_cache + i * S * Hkv * T * D;
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(threads)")
        for (long b = 0; b < B; ++b)
            for (long kv = 0; kv < Hkv; ++kv) {
                float* row = qkv + b * QKV_N;
                const float *c = cos + pos[b] * D, *s = sin + pos[b] * D;
                for (long g = 0; g < G; ++g) rotary(row + (kv * G + g) * D, c, s, D);
                float* kr = row + (Hq + kv) * D;
                rotary(kr, c, s, D);
                long seq = slots[b], col = cols[b];
                float *kslot = kc + (seq * Hkv + kv) * T * D, *vslot = vc + (seq * Hkv + kv) * T * D;
                for (long j = 0; j < D; ++j) {
                    kslot[col * D + j] = kr[j];
                    vslot[col * D + j] = row[(Hq + Hkv + kv) * D + j];
                }
                attend(row + kv * G * D, G, kslot, vslot, key_mask + seq * T, col + 1, D, scale,
                       attn + b * Hq * D + kv * G * D);
            }
        linear(kind, attn, B, lw[O], lw[O_BIAS], H, Hq * D, delta, threads);
        add_rms_norm(h, delta, (const float*)lw[LN2], x, B, H, eps);
        linear(kind, x, B, lw[GATE_UP], lw[GATE_UP_BIAS], 2 * I, H, gu, threads);
        silu_mul(gu, act, B, I);
        linear(kind, act, B, lw[DOWN], lw[DOWN_BIAS], H, I, delta, threads);
        const float* next = i + 1 < layers ? (const float*)w[(i + 1) * PER_LAYER + LN1] : final_norm;
        add_rms_norm(h, delta, next, x, B, H, eps);
    }
}
