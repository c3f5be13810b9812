// Linear layers over quantized weights on a CPU: out[M][N] = x[M][K] @ W^T (+ bias), W read as it is stored.
//
// Built with the other kernels of this folder by kernels/cpu_native.py; kernels/quant_linear.py owns the formats and
// holds the PyTorch reference (dequantize, then matmul) this kernel is tested against.
//
// Weight layouts, W [N][K] in groups of G consecutive inputs sharing a scale (G a multiple of 32; a last group may be
// shorter: ceil(K / G) groups a row):
//   KIND_INT4: q [N][K/2] bytes; in the 32-input block b of a row, byte j (0..15) holds q[32b+j] in its low nibble
//              and q[32b+16+j] in its high nibble (GGUF's Q4 order). w = q * scale + min, q in 0..15.
//   KIND_INT8: q [N][K] int8. w = q * scale (+ min where mins is not NULL).
//   KIND_FP8:  q [N][K] float8 e4m3fn codes. w = e4m3(q) * scale.
// scales, mins: [N][ceil(K/G)], fp16 or float32 (scales_f32, mins_f32). x, out: float32, row-major. bias: [N] float32 or
// NULL.
// int4 and int8 weights meet activations quantized to int8 per 32-input block (xq = round(x * 127 / amax), scale
// amax / 127: dynamic, like llama.cpp's CPU kernels), so each block is one integer dot product (AVX2: maddubs) scaled
// by (weight scale * activation scale), plus min * (activation scale * sum of codes). kernels/quant_linear.py's
// reference quantizes the activations the same way. fp8 weights are widened to float32 a tile of rows at a time
// (into a per-thread buffer) and meet float32 activations. Either way every row of x reads the weight bytes that one
// pass brought in, so they leave memory once per call whatever M is.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TM_AVX2 1
#endif

enum { KIND_INT4 = 0, KIND_INT8 = 1, KIND_FP8 = 2 };

#define ROWS_PER_PASS 4  // weight rows one register-blocked pass reads together (a tile is a multiple of it)

static float f16_to_f32(uint16_t h) {
#ifdef TM_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        int shift = 0;
        while (!(mantissa & 0x400)) { mantissa <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

// e4m3fn code -> the fp16 bits of its value / 256: the sign moves to bit 15, exponent and mantissa shift into fp16's
// fields (biases 7 and 15: 2^8 apart, subnormals included).
static inline uint16_t e4m3_as_f16_bits(uint8_t code) {
    return (uint16_t)(((code & 0x80) << 8) | ((code & 0x7F) << 7));
}

static inline float load_scale(const void *p, int64_t i, int f32) {
    return f32 ? ((const float *)p)[i] : f16_to_f32(((const uint16_t *)p)[i]);
}

// One fp8 weight row (K inputs) widened to float32 into dst; scales point at the row's first group.
static void widen_fp8_row(const uint8_t *q, const void *scales, int scales_f32, int64_t K, int64_t G, float *dst) {
    const int64_t per_group = G / 32;
    float d = 0.0f;
    for (int64_t b = 0, g = 0, left = 0; b < K / 32; b++, left--) {
        if (left == 0) {  // the next group's scale (a counter: a division per block costs more than the block)
            d = load_scale(scales, g++, scales_f32);
            left = per_group;
        }
        const uint8_t *p = q + 32 * b;
        float *o = dst + 32 * b;
        float scale = d * 256.0f;
#ifdef TM_AVX2
        __m256 vs = _mm256_set1_ps(scale);
        __m128i low = _mm_set1_epi16(0x7F), sign = _mm_set1_epi16(0x80);
        for (int j = 0; j < 32; j += 8) {
            __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(p + j)));
            __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, sign), 8),
                                     _mm_slli_epi16(_mm_and_si128(c, low), 7));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtph_ps(h), vs));
        }
#else
        for (int j = 0; j < 32; j++) o[j] = f16_to_f32(e4m3_as_f16_bits(p[j])) * scale;
#endif
    }
}

#ifdef TM_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

// out[m][0..3] (stride N) = rows 0..3 of w (stride K) . x[m], for rows m of x; w holds ROWS_PER_PASS rows.
static void dot_rows(const float *w, const float *x, int64_t M, int64_t K, float *out, int64_t N, int rows) {
    int64_t m = 0;
#ifdef TM_AVX2
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    for (; m + 2 <= M; m += 2) {
        const float *xa = x + m * K, *xb = xa + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
            __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
            __m256 v2 = _mm256_loadu_ps(w2 + k), v3 = _mm256_loadu_ps(w3 + k);
            a0 = _mm256_fmadd_ps(v0, va, a0); b0 = _mm256_fmadd_ps(v0, vb, b0);
            a1 = _mm256_fmadd_ps(v1, va, a1); b1 = _mm256_fmadd_ps(v1, vb, b1);
            a2 = _mm256_fmadd_ps(v2, va, a2); b2 = _mm256_fmadd_ps(v2, vb, b2);
            a3 = _mm256_fmadd_ps(v3, va, a3); b3 = _mm256_fmadd_ps(v3, vb, b3);
        }
        float ra[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)}, rb[4] = {hsum(b0), hsum(b1), hsum(b2), hsum(b3)};
        for (int j = 0; j < rows; j++) {
            out[m * N + j] = ra[j];
            out[(m + 1) * N + j] = rb[j];
        }
    }
    for (; m < M; m++) {
        const float *xa = x + m * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 va = _mm256_loadu_ps(xa + k);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), va, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), va, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), va, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), va, a3);
        }
        float ra[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
        for (int j = 0; j < rows; j++) out[m * N + j] = ra[j];
    }
#else
    for (; m < M; m++) {
        for (int j = 0; j < rows; j++) {
            const float *wj = w + j * K, *xm = x + m * K;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < K; k++) acc += wj[k] * xm[k];
            out[m * N + j] = acc;
        }
    }
#endif
}

// --- int4 / int8 weights against int8 activations

// Blocks i0 .. i1 - 1 of x [M][K] (float32, or bf16 where x_bf16: widened here, exactly; K a multiple of 32, so block
// i is elements 32 i .. 32 i + 31 of x as one array) -> their codes (xq + 32 i ..) and, per block, xd = its scale,
// xs = scale * sum of codes and xsum (NULL: none) = the sum of codes (an integer: |xsum| <= 32 * 127). On the calling
// thread.
// IEEE arithmetic here, whatever the build's flags: the reference divides 127 by amax exactly too, and a code at a
// rounding tie (x * inv = 57.5 happens) moves with the last bit of inv.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
void tm_quantize_blocks(const void *x, int x_bf16, int64_t i0, int64_t i1, int8_t *xq, float *xd, float *xs,
                        int32_t *xsum) {
    for (int64_t i = i0; i < i1; i++) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
        // The same IEEE operations as below, 16 lanes at a time, bf16 widened in registers: the same codes, 1.16x the
        // AVX2 loop's speed on Zen 4 (2,048 x 576 bf16 inputs on one thread, 338 against 393 us).
        __m512 a, b;
        if (x_bf16) {
            const __m512i h = _mm512_loadu_si512((const void *)((const uint16_t *)x + i * 32));
            a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
        } else {
            a = _mm512_loadu_ps((const float *)x + i * 32);
            b = _mm512_loadu_ps((const float *)x + i * 32 + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i ca =  // rounded half to even, as nearbyintf
            _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i cb =
            _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ca, cb));
        _mm_storeu_si128((__m128i *)(xq + i * 32), _mm512_cvtsepi32_epi8(ca));  // saturating, as the packs below
        _mm_storeu_si128((__m128i *)(xq + i * 32 + 16), _mm512_cvtsepi32_epi8(cb));
#else
        float wide[32];
        const float *v = (const float *)x + i * 32;
        if (x_bf16) {
            const uint16_t *h = (const uint16_t *)x + i * 32;
            for (int j = 0; j < 32; j++) {
                const uint32_t bits = (uint32_t)h[j] << 16;
                memcpy(wide + j, &bits, 4);
            }
            v = wide;
        }
#ifdef TM_AVX2
        // The same IEEE operations as below, 8 lanes at a time (round: half to even, as nearbyintf).
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 m0 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v)),
                                  _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8)));
        __m256 m1 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + 16)),
                                  _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 24)));
        __m256 m = _mm256_max_ps(m0, m1);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        float amax = _mm_cvtss_f32(h);
        __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i c[4];
        for (int j = 0; j < 4; j++)
            c[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), inv),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
        int sum = _mm_cvtsi128_si32(t);
        // int32 -> int8 in order: packs interleave 128-bit lanes, the permute restores 0..31.
        __m256i w16 = _mm256_packs_epi32(c[0], c[1]), z16 = _mm256_packs_epi32(c[2], c[3]);
        __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, z16),
                                                 _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + i * 32), b8);
#else
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            int code = (int)nearbyintf(v[j] * inv);
            xq[i * 32 + j] = (int8_t)code;
            sum += code;
        }
#endif
#endif
        xd[i] = amax / 127.0f;
        xs[i] = xd[i] * (float)sum;
        if (xsum) xsum[i] = sum;
    }
}
#pragma GCC pop_options

// Room for the quantized activations of M rows of K inputs in one allocation (this and quant_linear_x16.c's kernels):
// *xd [M][K / 32], *xs likewise, *xq [M][K], and where xsum is not NULL *xsum [M][K / 32]; free(*xd) releases them
// all. Returns 0, or -2 when memory runs out.
int tm_alloc_codes(int64_t M, int64_t K, int8_t **xq, float **xd, float **xs, int32_t **xsum) {
    const int64_t blocks = K / 32;
    float *buffer = (float *)malloc((size_t)((xsum ? 3 : 2) * M * blocks) * sizeof(float) + (size_t)(M * K));
    if (!buffer) return -2;
    *xd = buffer;
    *xs = buffer + M * blocks;
    *xq = (int8_t *)(buffer + 2 * M * blocks);
    if (xsum) *xsum = (int32_t *)(*xq + M * K);  // (K a multiple of 32: aligned as the floats)
    return 0;
}

// out [M][N] += bias [N] on every row.
void tm_add_bias(float *out, int64_t M, int64_t N, const float *bias) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) out[m * N + n] += bias[n];
}

#ifdef TM_AVX2
// The 32 codes of block b of an int4 / int8 weight row as unsigned bytes, and (int8) the signs to move onto x.
static inline __m256i load_codes(const uint8_t *q, int64_t b, int kind, __m256i *sign) {
    if (kind == KIND_INT4) {
        const __m128i nibble = _mm_set1_epi8(0x0F);
        __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * b));
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nibble), _mm_and_si128(v, nibble));
    }
    *sign = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
    return _mm256_sign_epi8(*sign, *sign);  // |w| as unsigned bytes; its sign moves onto x
}

#endif

// out[r * N] (r < MR) = weight row q . rows r of the quantized x (stride K); MR is a literal at each call, so the
// accumulators stay in registers.
static inline void dot_int_row(const uint8_t *q, const void *scales, const void *mins, int scales_f32, int mins_f32,
                               int kind, int64_t K, int64_t G, const int8_t *xq, const float *xd, const float *xs,
                               const int MR, float *out, int64_t N) {
    float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d = 0.0f, m = 0.0f;
    int64_t blocks = K / 32;
#ifdef TM_AVX2
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    const int64_t per_group = G / 32;
    for (int64_t b = 0, g = 0, left = 0; b < blocks; b++, left--) {
        if (left == 0) {  // the next group's scale (a counter: a division per block costs more than the block)
            d = load_scale(scales, g, scales_f32);
            m = mins ? load_scale(mins, g, mins_f32) : 0.0f;
            g++;
            left = per_group;
        }
#ifdef TM_AVX2
        __m256i sign = _mm256_setzero_si256(), w = load_codes(q, b, kind, &sign);
        for (int r = 0; r < MR; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + 32 * b));
            if (kind != KIND_INT4) xv = _mm256_sign_epi8(xv, sign);
            __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * xd[r * blocks + b]), acc[r]);
            tail[r] += m * xs[r * blocks + b];
        }
#else
        for (int r = 0; r < MR; r++) {
            const int8_t *xb = xq + r * K + 32 * b;
            int dot = 0;
            if (kind == KIND_INT4) {
                const uint8_t *p = q + 16 * b;
                for (int j = 0; j < 16; j++) dot += (p[j] & 0x0F) * xb[j] + (p[j] >> 4) * xb[16 + j];
            } else {
                const int8_t *p = (const int8_t *)q + 32 * b;
                for (int j = 0; j < 32; j++) dot += p[j] * xb[j];
            }
            tail[r] += (float)dot * d * xd[r * blocks + b] + m * xs[r * blocks + b];
        }
#endif
    }
    for (int r = 0; r < MR; r++) {
#ifdef TM_AVX2
        out[r * N] = hsum(acc[r]) + tail[r];
#else
        out[r * N] = tail[r];
#endif
    }
}

#ifdef TM_AVX2
// A lone row of x (a decode) against weight rows n and n + 1 at once: two independent accumulator chains share each
// block of x. rows = 2 writes out[0], out[1]; rows = 1 (the last, odd row) writes out[0] only.
static void dot_int_pair(const uint8_t *q, int64_t row_bytes, const void *scales, const void *mins, int scales_f32,
                         int mins_f32, int kind, int64_t K, int64_t G, const int8_t *xq, const float *xd,
                         const float *xs, float *out, int rows) {
    const uint8_t *q1 = rows > 1 ? q + row_bytes : q;
    int64_t groups = (K + G - 1) / G, per_group = G / 32, blocks = K / 32;
    size_t sb = scales_f32 ? 4 : 2, mb = mins_f32 ? 4 : 2;
    const char *s1 = (const char *)scales + (rows > 1 ? groups * sb : 0);
    const char *m1 = mins ? (const char *)mins + (rows > 1 ? groups * mb : 0) : NULL;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float tail0 = 0.0f, tail1 = 0.0f, d0 = 0.0f, d1 = 0.0f, n0 = 0.0f, n1 = 0.0f;
    for (int64_t b = 0, g = 0, left = 0; b < blocks; b++, left--) {
        if (left == 0) {
            d0 = load_scale(scales, g, scales_f32);
            d1 = load_scale(s1, g, scales_f32);
            n0 = mins ? load_scale(mins, g, mins_f32) : 0.0f;
            n1 = mins ? load_scale(m1, g, mins_f32) : 0.0f;
            g++;
            left = per_group;
        }
        __m256i sign0 = _mm256_setzero_si256(), sign1 = sign0;
        __m256i w0 = load_codes(q, b, kind, &sign0), w1 = load_codes(q1, b, kind, &sign1);
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * b)), x0 = xv, x1 = xv;
        if (kind != KIND_INT4) {
            x0 = _mm256_sign_epi8(xv, sign0);
            x1 = _mm256_sign_epi8(xv, sign1);
        }
        __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones);
        __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d0 * xd[b]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d1 * xd[b]), acc1);
        tail0 += n0 * xs[b];
        tail1 += n1 * xs[b];
    }
    out[0] = hsum(acc0) + tail0;
    if (rows > 1) out[1] = hsum(acc1) + tail1;
}
#endif

static int int_linear(const float *x, int64_t M, int64_t K, const void *q, const void *scales, const void *mins,
                      int scales_f32, int mins_f32, int64_t N, int kind, int64_t G, float *out) {
    int64_t blocks = K / 32, row_bytes = kind == KIND_INT4 ? K / 2 : K;
    int8_t *xq;
    float *xd, *xs;
    if (tm_alloc_codes(M, K, &xq, &xd, &xs, NULL) != 0) return -2;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t i = 0; i < M * blocks; i++) tm_quantize_blocks(x, 0, i, i + 1, xq, xd, xs, NULL);
    size_t scale_bytes = scales_f32 ? 4 : 2, min_bytes = mins_f32 ? 4 : 2;
    int64_t groups = (K + G - 1) / G;
#ifdef TM_AVX2
    if (M == 1 && kind == KIND_INT4) {  // (int8 measured no faster in pairs)
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n += 2)
            dot_int_pair((const uint8_t *)q + n * row_bytes, row_bytes, (const char *)scales + n * groups * scale_bytes,
                         mins ? (const char *)mins + n * groups * min_bytes : NULL, scales_f32, mins_f32, kind, K, G,
                         xq, xd, xs, out + n, N - n > 1 ? 2 : 1);
        free(xd);
        return 0;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = (const uint8_t *)q + n * row_bytes;
        const void *sn = (const char *)scales + n * groups * scale_bytes;
        const void *mn = mins ? (const char *)mins + n * groups * min_bytes : NULL;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4)
            dot_int_row(qn, sn, mn, scales_f32, mins_f32, kind, K, G, xq + r * K, xd + r * blocks, xs + r * blocks,
                        4, out + r * N + n, N);
        for (; r < M; r++)
            dot_int_row(qn, sn, mn, scales_f32, mins_f32, kind, K, G, xq + r * K, xd + r * blocks, xs + r * blocks,
                        1, out + r * N + n, N);
    }
    free(xd);
    return 0;
}

// --- fp8 weights, widened

static __thread void *scratch;
static __thread int64_t scratch_bytes;

// This thread's scratch of at least ``bytes`` (64-byte aligned; NULL when memory runs out), kept for its next call.
// One a thread: a kernel holds it for the length of one call (the fp8 tiles here, quant_linear_x16.c's AMX tiles).
void *tm_thread_scratch(int64_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

// Returns 0, or -1 for a shape outside the layouts above, -2 when a thread's tile buffer cannot be allocated.
int tm_quant_linear(const float *x, int64_t M, int64_t K, const void *q, const void *scales, const void *mins,
                    int scales_f32, int mins_f32, int64_t N, int kind, int64_t G, const float *bias, float *out,
                    int64_t tile_rows) {
    if (K % 32 || G % 32 || G <= 0 || tile_rows % ROWS_PER_PASS || tile_rows <= 0 || kind < 0 || kind > 2) return -1;
    if (kind != KIND_FP8) {
        int code = int_linear(x, M, K, q, scales, mins, scales_f32, mins_f32, N, kind, G, out);
        if (code == 0 && bias) tm_add_bias(out, M, N, bias);
        return code;
    }
    int64_t row_bytes = K, groups = (K + G - 1) / G, tiles = (N + tile_rows - 1) / tile_rows;
    int failed = 0;
#pragma omp parallel
    {
        float *w = (float *)tm_thread_scratch(tile_rows * K * (int64_t)sizeof(float));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!w) continue;
            int64_t first = t * tile_rows, rows = N - first < tile_rows ? N - first : tile_rows;
            for (int64_t r = 0; r < rows; r++)
                widen_fp8_row((const uint8_t *)q + (first + r) * row_bytes,
                              (const char *)scales + (first + r) * groups * (scales_f32 ? 4 : 2), scales_f32, K, G,
                              w + r * K);
            if (rows < tile_rows) memset(w + rows * K, 0, (size_t)((tile_rows - rows) * K) * sizeof(float));
            for (int64_t r = 0; r < rows; r += ROWS_PER_PASS) {
                int n = rows - r < ROWS_PER_PASS ? (int)(rows - r) : ROWS_PER_PASS;
                dot_rows(w + r * K, x, M, K, out + first + r, N, n);
            }
            if (bias)
                for (int64_t m = 0; m < M; m++)
                    for (int64_t r = 0; r < rows; r++) out[m * N + first + r] += bias[first + r];
        }
    }
    return failed ? -2 : 0;
}

// A weight's constant arguments, prepared once by the caller (kernels/quant_linear.py CPUQuantMatmul): a call then
// passes four arguments, not fourteen (the foreign-function call's conversions cost microseconds each).
typedef struct {
    const void *q, *scales, *mins;
    const float *bias;
    int64_t K, N, G, tile_rows;
    int32_t scales_f32, mins_f32, kind, unused;
} tm_quant_weight;

int tm_quant_linear_prepared(const tm_quant_weight *w, const float *x, int64_t M, float *out) {
    return tm_quant_linear(x, M, w->K, w->q, w->scales, w->mins, w->scales_f32, w->mins_f32, w->N, w->kind, w->G,
                           w->bias, out, w->tile_rows);
}
