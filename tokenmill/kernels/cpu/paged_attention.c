// Attention of queries over the paged KV cache, read in place through the block table (no gather), on a CPU.
//
// Built at first use by kernels/cpu_native.py with the host's compiler for the host's vector units
// (-march=native); kernels/paged_attention.py holds the PyTorch reference it is tested against.
//
// Layout (kvcache/spec.py): cache[num_blocks + 1][block_size][2 * Hkv][D], K heads then V heads per token;
// fp8 caches carry scales[num_blocks + 1][block_size][2 * Hkv] (value = e4m3(code) * scale).
// Work is split into segments: segment s is q_len[s] consecutive queries (rows q_start[s].. of q [N][Hq][D], float32)
// of the request whose block-table row is req[s], each seeing tokens kv_first[s] .. kv_len[s] - 1 of that request's
// cache (kv_first > 0: a sliding window's start). A causal segment (causal[s] = 1; causal NULL: none) narrows that
// per query: its query j sees tokens kv_first[s] .. kv_len[s] - q_len[s] + j, i.e. a prefill chunk whose own tokens
// are already in the cache attends its prefix and itself, causally, in one segment.
// A decode is a segment of one query over its whole sequence; a prefill chunk is either a causal segment over its
// whole sequence, or a segment of its queries over its cached prefix (its own tokens attended elsewhere and merged
// through ``lse``).
// softcap > 0 caps every scaled score to softcap * tanh(score / softcap) (attention logit soft-capping).
// Output: out [N][Hq][D] float32 and lse [N][Hq] (natural log of the softmax denominator, scores scaled); a query
// that sees no token gets out = 0, lse = -inf.
// Online softmax over the cache one block at a time: each block's K/V are widened to float32 once per
// (segment, group of adjacent KV heads, query tile, part) and shared by the tile's G = Hq / Hkv query heads per KV
// head; the next block's are prefetched meanwhile, a slice per row. Too few such items for the threads (a lone
// long decode) -> segments are split along their cache into parts whose softmax states are merged at the end
// (split-K, as flash decoding does).
// Where the build has AVX512-BF16 a bf16 cache under bf16 queries (q_bf16: the float32 rows hold bf16 values) skips
// the widening: the bf16 path below (walk_bf16) reads K and V in place, the G query rows of a KV head together. With
// AVX512-VBMI too, an fp8 cache under bf16 queries takes the same path (walk_fp8): its codes become bf16 by two byte
// lookups, 16 tokens of a head at a time, and its scales multiply the scores (K) and the probabilities (V).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2, KIND_FP8 = 3 };

#define TILE_ROWS 64  // query-head rows sharing one widened block
#define NEG_BIG (-1e30f)  // the running maximum before any score (finite: built with -ffast-math)

// Floats of one row's accumulators in a tile's scratch: D padded to whole chunks of 32 (the bf16 path's unit).
static inline int padded_dim(int D) { return (D + 31) / 32 * 32; }

static float fp8_table[256];

// e4m3fn magnitude codes (7 bits) -> the high and low bytes of their values' bf16 (exact: 4 significant bits), for
// the fp8 path's byte lookups (fp8_rows_bf16); the NaN code reads 0, as fp8_table has it.
static uint8_t fp8_bf16_hi[128] __attribute__((aligned(64))), fp8_bf16_lo[128] __attribute__((aligned(64)));

static float e4m3_value(int code) {
    int sign = code & 0x80, exponent = (code >> 3) & 0xF, mantissa = code & 0x7;
    float v;
    if (exponent == 0xF && mantissa == 0x7) v = 0.0f;  // NaN code: the cache never holds it
    else if (exponent == 0) v = ldexpf((float)mantissa / 8.0f, -6);
    else v = ldexpf(1.0f + (float)mantissa / 8.0f, exponent - 7);
    return sign ? -v : v;
}

static float f16_value(uint16_t h) {
    int sign = h >> 15, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    float v;
    if (exponent == 0) v = ldexpf((float)mantissa, -24);
    else if (exponent == 31) v = mantissa ? NAN : INFINITY;
    else v = ldexpf(1.0f + (float)mantissa / 1024.0f, exponent - 15);
    return sign ? -v : v;
}

// 1 where this build has the bf16 path (AVX512-BF16): what a bf16 model's decode attention runs here.
int tm_attention_bf16_dot(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return 1;
#else
    return 0;
#endif
}

// 1 where this build converts an fp8 cache's codes to bf16 in registers (AVX512-BF16 and AVX512-VBMI): what a bf16
// model's attention over an fp8 cache runs here (else the float32 widening path). Defined after the path's code.
int tm_attention_fp8_path(void);

void tm_init(void) {
    for (int i = 0; i < 256; i++) fp8_table[i] = e4m3_value(i);
    for (int i = 0; i < 128; i++) {
        uint32_t bits;
        memcpy(&bits, &fp8_table[i], sizeof bits);
        fp8_bf16_hi[i] = (uint8_t)(bits >> 24);
        fp8_bf16_lo[i] = (uint8_t)(bits >> 16);
    }
}

// n values of one cache row (element kind) -> dst float32, times scale (fp8 only).
static inline void widen(float *dst, const void *src, int64_t offset, int n, int kind, float scale) {
    if (kind == KIND_F32) {
        memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
    } else if (kind == KIND_BF16) {
        const uint16_t *p = (const uint16_t *)src + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)p[i] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            dst[i] = f;
        }
    } else if (kind == KIND_F16) {
        const uint16_t *p = (const uint16_t *)src + offset;
        for (int i = 0; i < n; i++) dst[i] = f16_value(p[i]);
    } else {
        const uint8_t *p = (const uint8_t *)src + offset;
        int i = 0;
#if defined(__AVX2__) && defined(__F16C__)
        // e4m3fn -> the fp16 of its value / 256 (sign to bit 15, exponent and mantissa shifted into fp16's fields,
        // biases 7 and 15: 2^8 apart, subnormals included), widened by the F16C unit; times scale * 256 (exact: a
        // power of two), so the product rounds once, as the table's value * scale does.
        const __m128i sign = _mm_set1_epi16(0x80), magnitude = _mm_set1_epi16(0x7F);
        const __m256 scaled = _mm256_set1_ps(scale * 256.0f);
        for (; i + 8 <= n; i += 8) {
            __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(p + i)));
            __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, sign), 8),
                                     _mm_slli_epi16(_mm_and_si128(c, magnitude), 7));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), scaled));
        }
#endif
        for (; i < n; i++) dst[i] = fp8_table[p[i]] * scale;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// The lane sums of eight vectors: lane j of the result = the sum of a[j]'s lanes.
static inline __m256 sum_lanes8(const __m256 *a) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

// scores[t] = qr . k_t for t < n (k_t at kbuf + t * stride). With AVX2 and D a multiple of 8, eight tokens at a
// time: one accumulator chain per token, summed across lanes by one transpose-add (a single chain would wait on
// every FMA's latency in turn). A last partial group repeats token n - 1 and keeps only the first n - t sums.
static inline __attribute__((always_inline)) void dot_tokens(const float *restrict qr, const float *restrict kbuf,
                                                             int n, int stride, const int D, float *restrict scores) {
    int t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        for (; t < n; t += 8) {
            const float *k[8];
            for (int j = 0; j < 8; j++) k[j] = kbuf + (int64_t)(t + j < n ? t + j : n - 1) * stride;
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qr + d);
                for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), a[j]);
            }
            if (t + 8 <= n) {
                _mm256_storeu_ps(scores + t, sum_lanes8(a));
            } else {
                float last[8];
                _mm256_storeu_ps(last, sum_lanes8(a));
                memcpy(scores + t, last, sizeof(float) * (size_t)(n - t));
            }
        }
        return;
    }
#endif
    for (; t < n; t++) {
        const float *restrict k = kbuf + (int64_t)t * stride;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int d = 0; d < D; d++) s += qr[d] * k[d];
        scores[t] = s;
    }
}

// A block's scores scaled (and soft-capped where softcap > 0) in place; returns their maximum.
static inline float scale_scores(float *restrict scores, int n, float sm_scale, float softcap) {
    float block_max = NEG_BIG;
    for (int t = 0; t < n; t++) {
        float s = scores[t] * sm_scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        scores[t] = s;
        block_max = s > block_max ? s : block_max;
    }
    return block_max;
}

// One query-head row over one widened block of n tokens (token t's head at kbuf + t * stride): scores, the
// online-softmax update of (m, l), acc += p V.
// Always inlined with D a constant where the caller knows it (64, 128): the loops unroll and the accumulator row
// stays in registers.
static inline __attribute__((always_inline)) void row_over_block(
        const float *restrict qr, float *restrict a, const float *restrict kbuf, const float *restrict vbuf, int n,
        int stride, const int D, float sm_scale, float softcap, float *restrict m, float *restrict l,
        float *restrict scores) {
    dot_tokens(qr, kbuf, n, stride, D, scores);
    const float block_max = scale_scores(scores, n, sm_scale, softcap);
    const float m_new = block_max > *m ? block_max : *m;
    const float correction = expf(*m - m_new);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < n; t++) {
        scores[t] = expf(scores[t] - m_new);
        sum += scores[t];
    }
    *l = *l * correction + sum;
    *m = m_new;
    float acc[D];
#pragma omp simd
    for (int d = 0; d < D; d++) acc[d] = a[d] * correction;
    for (int t = 0; t < n; t++) {
        const float p = scores[t];
        const float *restrict v = vbuf + (int64_t)t * stride;
#pragma omp simd
        for (int d = 0; d < D; d++) acc[d] += p * v[d];
    }
#pragma omp simd
    for (int d = 0; d < D; d++) a[d] = acc[d];
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_DPBF16 1
// The bf16 path: a bf16 cache and queries whose values are bf16 (a bf16 model), D a multiple of 16. K and V are
// read in place as bf16, no widening: vdpbf16ps multiplies pairs of bf16 and adds them into float32 lanes, 32
// elements of d (a "chunk"; the last one masked at D) per 512-bit register. The cache is taken SUB tokens at a time.
// - Scores: one accumulator per token, lane i summing q[2i] k[2i] + q[2i + 1] k[2i + 1] over the chunks; the SUB
//   accumulators are summed across lanes by one transpose-add (sum16) into one register of SUB scores. Exact
//   products, float32 sums, as the widened path.
// - Softmax in that register (softmax16): the probabilities are rounded to bf16 (as flash attention does before its
//   P V product; the output is bf16 anyway) and the softmax denominator sums the rounded values, so each row stays a
//   convex combination of V.
// - P V (pv_rows): the query rows of one KV head go together, sharing each V load. Tokens go in pairs: unpacking two
//   V rows interleaves (V[t][d], V[t+1][d]), one vdpbf16ps by the pair (p[t], p[t+1]) adds both. The unpack works
//   within 128-bit lanes, so a row's float32 accumulators hold each chunk in a permuted order (chunk_position),
//   restored when the row is written out (a row's accumulators are padded to whole chunks: padded_dim).
#define SUB 16        // cache tokens per softmax step: one 512-bit register of float32 scores
#define PV_ROWS 8     // most query rows one pass of pv_rows carries (2 accumulators each per chunk in registers)

// Where d's accumulator sits in a permuted row: in each chunk of 32, the low unpack's lanes (d % 8 < 4) first.
static inline int chunk_position(int d) {
    const int chunk = d & ~31, e = d & 31, lane = e >> 3, i = e & 7;
    return chunk + (i < 4 ? 4 * lane + i : 16 + 4 * lane + i - 4);
}

// The bf16 of float32 x rounded to nearest even (x finite).
static inline uint16_t bf16_round(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// The mask of chunk c's elements below D (epi16 lanes).
static inline __mmask32 chunk_mask(int c, int D) {
    const int left = D - 32 * c;
    return left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1u);
}

// Lane j of the result = the sum of a[j]'s 16 lanes: pairs, then quads, within 128-bit lanes, then across them.
static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: (a2i, a2i+1) halves summed, interleaved
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // per 128-bit lane: tokens 4i .. 4i + 3, one partial sum each
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

// One query row (bf16 codes qb) over n <= SUB tokens of the cache (K of token t at k + t * stride): its SUB scores,
// lanes >= n repeating token n - 1.
static inline __attribute__((always_inline)) __m512 scores16(const uint16_t *restrict qb, const uint16_t *restrict k,
                                                             int n, int64_t stride, const int D) {
    const int chunks = (D + 31) / 32;
    __m512i q[chunks];
    for (int c = 0; c < chunks; c++) q[c] = _mm512_maskz_loadu_epi16(chunk_mask(c, D), qb + 32 * c);
    __m512 acc[SUB];
    for (int j = 0; j < SUB; j++) {
        const uint16_t *kt = k + (int64_t)(j < n ? j : n - 1) * stride;
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < chunks; c++)
            a = _mm512_dpbf16_ps(a, (__m512bh)q[c], (__m512bh)_mm512_maskz_loadu_epi16(chunk_mask(c, D), kt + 32 * c));
        acc[j] = a;
    }
    return sum16(acc);
}

// Every lane = the maximum (all_max) or the sum (all_sum) of x's 16 lanes, without leaving the vector registers.
static inline __m512 all_max(__m512 x) {
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
    x = _mm512_max_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_max_ps(x, _mm512_permute_ps(x, 0xB1));
}

static inline __m512 all_sum(__m512 x) {
    x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
    x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
}

// A row's raw scores of n <= SUB tokens (an fp8 cache: of its codes' values, times kscale[t] here) -> its
// probabilities rounded to bf16 in pb[0 .. SUB) (0 from n on; an fp8 cache: each times vscale[t] first) and the
// online-softmax update of (m, l); returns the factor the row's accumulators are to be scaled by first. All in vector
// registers (a row's softmax is one chain of dependent steps: scalar round trips would lengthen it); the denominator
// too is kept per lane (l: its lanes sum to it), summed once when the walk ends. The factor is 1 without an exp where
// the running maximum held (most blocks, once a sequence's first few have been seen).
static inline float softmax16(__m512 s, int n, float sm_scale, float softcap, float *restrict m, __m512 *restrict l,
                              uint16_t *restrict pb, const float *restrict kscale, const float *restrict vscale) {
    const __mmask16 valid = (__mmask16)(n >= SUB ? 0xFFFFu : (1u << n) - 1u);
    if (kscale) s = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(valid, kscale));
    s = _mm512_mul_ps(s, _mm512_set1_ps(sm_scale));
    if (softcap > 0.0f) {
        float v[SUB];
        _mm512_storeu_ps(v, s);
        for (int t = 0; t < n; t++) v[t] = softcap * tanhf(v[t] / softcap);
        s = _mm512_loadu_ps(v);
    }
    const __m512 m_old = _mm512_set1_ps(*m);
    const __m512 m_new = _mm512_max_ps(m_old, all_max(_mm512_mask_mov_ps(m_old, valid, s)));
    const __m512 p = _mm512_maskz_mov_ps(valid, tm_exp16(_mm512_sub_ps(s, m_new)));
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(p);
    // P V's weights: the rounded probabilities, or (an fp8 cache) each times its token's V scale, rounded once
    _mm256_storeu_si256((__m256i *)pb, vscale ? (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                                    p, _mm512_maskz_loadu_ps(valid, vscale))) : rounded);
    const __m512 kept = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    const float top = _mm512_cvtss_f32(m_new);
    // 0 after NEG_BIG (e^-87 and below)
    const float correction = top > *m ? _mm512_cvtss_f32(tm_exp16(_mm512_set1_ps(*m - top))) : 1.0f;
    *l = _mm512_fmadd_ps(*l, _mm512_set1_ps(correction), kept);
    *m = top;
    return correction;
}

// acc_r = acc_r * correction[r] + P_r V for R rows (accumulator rows a[r], probabilities pb + r * SUB) over n <= SUB
// tokens (V of token t at v + t * stride). An odd n's last token pairs with a zero weight and its own row again.
static inline __attribute__((always_inline)) void pv_rows(float *const *a, const float *correction,
                                                          const uint16_t *pb, const uint16_t *restrict v, int n,
                                                          int64_t stride, int D, const int R) {
    for (int c = 0; c < (D + 31) / 32; c++) {
        const __mmask32 mask = chunk_mask(c, D);
        __m512 lo[PV_ROWS], hi[PV_ROWS];
        for (int r = 0; r < R; r++) {
            const __m512 scale = _mm512_set1_ps(correction[r]);
            lo[r] = _mm512_mul_ps(_mm512_loadu_ps(a[r] + 32 * c), scale);
            hi[r] = _mm512_mul_ps(_mm512_loadu_ps(a[r] + 32 * c + 16), scale);
        }
        for (int t = 0; t < n; t += 2) {
            const uint16_t *v0 = v + (int64_t)t * stride, *v1 = t + 1 < n ? v0 + stride : v0;
            const __m512i x0 = _mm512_maskz_loadu_epi16(mask, v0 + 32 * c);
            const __m512i x1 = _mm512_maskz_loadu_epi16(mask, v1 + 32 * c);
            const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
            const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
            for (int r = 0; r < R; r++) {
                uint32_t pair;
                memcpy(&pair, pb + r * SUB + t, sizeof pair);
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
                lo[r] = _mm512_dpbf16_ps(lo[r], low, pp);
                hi[r] = _mm512_dpbf16_ps(hi[r], high, pp);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm512_storeu_ps(a[r] + 32 * c, lo[r]);
            _mm512_storeu_ps(a[r] + 32 * c + 16, hi[r]);
        }
    }
}

// pv_rows for any count of rows: passes of up to PV_ROWS, each with its count a constant.
static void pv_group(float *const *a, const float *correction, const uint16_t *pb, const uint16_t *v, int n,
                     int64_t stride, int D, int rows) {
    for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
        const int R = rows - r0 < PV_ROWS ? rows - r0 : PV_ROWS;
        float *const *ar = a + r0;
        const float *cr = correction + r0;
        const uint16_t *pr = pb + r0 * SUB;
        switch (R) {
            case 1: pv_rows(ar, cr, pr, v, n, stride, D, 1); break;
            case 2: pv_rows(ar, cr, pr, v, n, stride, D, 2); break;
            case 3: pv_rows(ar, cr, pr, v, n, stride, D, 3); break;
            case 4: pv_rows(ar, cr, pr, v, n, stride, D, 4); break;
            case 5: pv_rows(ar, cr, pr, v, n, stride, D, 5); break;
            case 6: pv_rows(ar, cr, pr, v, n, stride, D, 6); break;
            case 7: pv_rows(ar, cr, pr, v, n, stride, D, 7); break;
            default: pv_rows(ar, cr, pr, v, n, stride, D, PV_ROWS); break;
        }
    }
}
#endif

// Where prefetch_slice asks for the next block's lines to go: 0 = into the L1 (prefetcht0), 1 = only as far as the
// L2 (prefetcht2). Settled once at start-up by timing both (engine/attention_prefetch.py): a core tracks only so
// many outstanding L1 misses, and on a Zen 4 EPYC a block asked into the L1 held them while the compute's own loads
// waited (the L2 target was 1.15-1.64x faster there); other hosts are measured, not assumed.
static int prefetch_to_l2 = 0;

void tm_set_attention_prefetch(int to_l2) { prefetch_to_l2 = to_l2 != 0; }

// This step's new K / V into the cache (16- or 32-bit caches, the model's own dtype; fp8 is quantized by the
// reference): token t's heads k[t * k_stride + h * dim + i] (elements) go to cache slot slots[t] as its first hkv
// rows, v's as the next hkv (the layout of kernels/kv_write.py: data[slot][2 hkv][dim]). A negative slot (a padding
// row) writes nothing. Returns 0, or -1 (nothing written) where a slot is past the cache's num_slots.
int tm_write_kv(void *cache, int64_t num_slots, const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                const int64_t *slots, int64_t T, int64_t hkv, int64_t dim, int64_t elem_bytes) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -1;
    const size_t head_bytes = (size_t)(hkv * dim * elem_bytes);
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        char *slot = (char *)cache + (size_t)slots[t] * 2 * head_bytes;
        memcpy(slot, (const char *)k + (size_t)(t * k_stride * elem_bytes), head_bytes);
        memcpy(slot + head_bytes, (const char *)v + (size_t)(t * v_stride * elem_bytes), head_bytes);
    }
    return 0;
}

int tm_attention_prefetch(void) { return prefetch_to_l2; }

// One line asked into the L1 or the L2. (GCC 12 drops this file's __builtin_prefetch calls at -O2, and at -O3 too
// once the hint is chosen at run time, however the branch is written: on x86 the instruction is written in asm.)
static inline __attribute__((always_inline)) void prefetch_line(const char *p, int to_l2) {
#if defined(__x86_64__)
    if (to_l2)
        __asm__ volatile("prefetcht2 %0" : : "m"(*p));
    else
        __asm__ volatile("prefetcht0 %0" : : "m"(*p));
#else
    if (to_l2)
        __builtin_prefetch(p, 0, 1);
    else
        __builtin_prefetch(p, 0, 3);
#endif
}

// The next cache block's K and V runs (``tokens`` tokens from ``first``, heads h0.., ``run`` bytes each), asked
// into the caches a slice of tokens at a time: slice ``r`` of ``slices`` goes out at the r-th of as many points spread
// over the current block's compute (the bf16 walk: before each row's scores and before its softmax; the widening
// path: before each row), so the loads overlap that compute. (Blocks sit at random places, where the hardware
// prefetcher does not follow. All the lines at once fill the core's miss buffers and stall it: 1.7x slower from
// memory on a Zen 5; a slice per row rather than two, 1.15-1.2x slower at 16-32 decodes: BENCHMARKS.md, issue 24,
// "Memory asked for ahead".)
static inline void prefetch_slice(const char *cache, int64_t first, int tokens, int slots, int h0, int Hkv, int D,
                                  int elem, int run, int r, int slices) {
    const int from = (int)((int64_t)r * tokens / slices), to = (int)((int64_t)(r + 1) * tokens / slices);
    const int64_t token_bytes = (int64_t)slots * D * elem, v_offset = (int64_t)Hkv * D * elem;
    const char *k = cache + (first + from) * token_bytes + (int64_t)h0 * D * elem;
    const int to_l2 = prefetch_to_l2;
    for (int t = from; t < to; t++, k += token_bytes)
        for (int off = 0; off < run; off += 64) {
            prefetch_line(k + off, to_l2);
            prefetch_line(k + v_offset + off, to_l2);
        }
}

#ifdef HAVE_DPBF16
#if defined(__AVX512VBMI__)
#define HAVE_FP8_PATH 1
// An fp8 cache's rows -> their values' bf16 codes in natural order (rows of D codes at src + i * src_stride bytes ->
// dst + i * D), 64 codes a step: two byte lookups (vpermi2b over 128-entry tables: the low bytes, and the high bytes
// with the sign or'ed in), then the bytes interleaved into words. The unpack works within 128-bit lanes, so the
// codes are first put in the order it undoes (``order``).
static inline void fp8_rows_bf16(const uint8_t *restrict src, int64_t src_stride, int rows, uint16_t *restrict dst,
                                 int D) {
    const __m512i lo0 = _mm512_load_si512(fp8_bf16_lo), lo1 = _mm512_load_si512(fp8_bf16_lo + 64);
    const __m512i hi0 = _mm512_load_si512(fp8_bf16_hi), hi1 = _mm512_load_si512(fp8_bf16_hi + 64);
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    // byte 16j + i of the reordered codes is code 8j + i (i < 8) or 32 + 8j + (i - 8): lane j's low unpack then
    // yields codes 8j .. 8j + 7 (words 8j ..), its high unpack codes 32 + 8j .. (words 32 + 8j ..)
    const __m512i order = _mm512_set_epi8(
        63, 62, 61, 60, 59, 58, 57, 56, 31, 30, 29, 28, 27, 26, 25, 24, 55, 54, 53, 52, 51, 50, 49, 48, 23, 22, 21, 20,
        19, 18, 17, 16, 47, 46, 45, 44, 43, 42, 41, 40, 15, 14, 13, 12, 11, 10, 9, 8, 39, 38, 37, 36, 35, 34, 33, 32,
        7, 6, 5, 4, 3, 2, 1, 0);
    for (int i = 0; i < rows; i++, src += src_stride, dst += D)
        for (int c = 0; c < D; c += 64) {
            const int left = D - c;
            const __mmask64 load = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
            const __m512i x = _mm512_permutexvar_epi8(order, _mm512_maskz_loadu_epi8(load, src + c));
            const __m512i lo = _mm512_permutex2var_epi8(lo0, x, lo1);
            const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, x, hi1), x, sign, 0xF8);
            _mm512_mask_storeu_epi16(dst + c, left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1u),
                                     _mm512_unpacklo_epi8(lo, hi));
            if (left > 32)
                _mm512_mask_storeu_epi16(dst + c + 32, left >= 64 ? (__mmask32)0xFFFFFFFFu
                                                                  : (__mmask32)((1u << (left - 32)) - 1u),
                                         _mm512_unpackhi_epi8(lo, hi));
        }
}
#endif

// attend_tile's bf16 path over the cache: its rows (query, head, group member) with their bf16 codes qb, running
// maxima m, denominators l and accumulators acc + r * padded_dim(D) (permuted while the walk lasts, in d order after).
// A bf16 cache (fp8 = 0, scales NULL) is read in place. An fp8 cache (fp8 = 1; a constant: each kind compiles to its
// own loop) has each SUB tokens' K and V codes of the tile's heads converted to bf16 once into kv16 (exact: every e4m3
// value is a bf16; [K, V][head][cap tokens][D], cap = min(SUB, block_size)), which the same code then reads, K's
// scales multiplying the scores and V's the probabilities.
static inline __attribute__((always_inline)) void walk(
        const void *cache, const float *scales, const int64_t *blocks, int kv_lo, int kv_hi, const int *query_end,
        int rows, int h0, int hc, int G, int Hkv, int D, int block_size, float sm_scale, float softcap, float *m,
        float *l, float *acc, const uint16_t *qb, uint16_t *kv16, const int fp8) {
    const int slots = 2 * Hkv, elem = fp8 ? 1 : 2, run = hc * D * elem;  // run: bytes of a token's K (or V) heads
    const int64_t stride = (int64_t)slots * D;  // elements from one token's row to the next
    const int cap = block_size < SUB ? block_size : SUB;
    uint16_t pb[TILE_ROWS * SUB];
    float correction[TILE_ROWS];
    __m512 row_scores[TILE_ROWS], lanes[TILE_ROWS];  // lanes[r]: row r's denominator, per lane (see softmax16)
    float kv_scale[2 * TILE_ROWS * SUB];  // an fp8 cache's scales of kv16's rows: [K, V][head][token]
    float *arow[TILE_ROWS];
    for (int r = 0; r < rows; r++) {
        arow[r] = acc + (int64_t)r * padded_dim(D);
        lanes[r] = _mm512_setzero_ps();
    }
    for (int start = kv_lo - kv_lo % block_size; start < kv_hi; start += block_size) {
        const int skip = kv_lo > start ? kv_lo - start : 0;
        const int count = (kv_hi - start < block_size ? kv_hi - start : block_size) - skip;
        const int64_t first = blocks[start / block_size] * block_size + skip;  // the cache slot of the first token
        const int has_next = start + block_size < kv_hi;
        const int64_t next = has_next ? blocks[start / block_size + 1] * block_size : 0;
        if (fp8 && has_next)  // the next block's scales (its codes go out a slice per row below)
            for (int64_t off = 0; off < (int64_t)block_size * slots * 4; off += 64)
                prefetch_line((const char *)(scales + next * slots) + off, prefetch_to_l2);
        for (int sub = 0; sub < count; sub += SUB) {
            const int n = count - sub < SUB ? count - sub : SUB;
            const int64_t token = first + sub;
            const int position = start + skip + sub;  // of the cache's token ``token`` in the sequence
#ifdef HAVE_FP8_PATH
            if (fp8) {
                const uint8_t *codes = (const uint8_t *)cache + token * stride;
                for (int hh = 0; hh < hc; hh++)
                    for (int kv = 0; kv < 2; kv++) {
                        const int slot = kv * Hkv + h0 + hh, at = kv * hc + hh;
                        fp8_rows_bf16(codes + (int64_t)slot * D, stride, n, kv16 + (int64_t)at * cap * D, D);
                        for (int t = 0; t < n; t++) kv_scale[at * SUB + t] = scales[(token + t) * slots + slot];
                    }
            }
#endif
            // The G rows of one query over one KV head: their scores, then their softmaxes (each a chain of dependent
            // steps: side by side, a core overlaps the rows'), then P V for all G at once. ``live`` of the n tokens
            // are the query's to see (fewer only for a causal segment's queries; none: its rows are left as they are).
            for (int g0 = 0; g0 < rows; g0 += G) {
                const int hh = (g0 / G) % hc, kh = h0 + hh;
                const int64_t row_stride = fp8 ? D : stride;
                const uint16_t *k = fp8 ? kv16 + (int64_t)hh * cap * D
                                        : (const uint16_t *)cache + token * stride + (int64_t)kh * D;
                const uint16_t *v = fp8 ? kv16 + (int64_t)(hc + hh) * cap * D
                                        : (const uint16_t *)cache + token * stride + (int64_t)(Hkv + kh) * D;
                const float *kscale = fp8 ? kv_scale + hh * SUB : NULL;
                const float *vscale = fp8 ? kv_scale + (hc + hh) * SUB : NULL;
                const int seen = query_end ? query_end[g0 / (hc * G)] - position : n;
                const int live = seen < n ? (seen > 0 ? seen : 0) : n;
                for (int r = g0; r < g0 + G; r++) {
                    if (has_next && sub == 0)
                        prefetch_slice((const char *)cache, next, block_size, slots, h0, Hkv, D, elem, run, 2 * r,
                                       2 * rows);
                    if (!live) continue;
                    const uint16_t *qr = qb + (int64_t)r * D;
                    if (D == 64)
                        row_scores[r] = scores16(qr, k, live, row_stride, 64);
                    else if (D == 128)
                        row_scores[r] = scores16(qr, k, live, row_stride, 128);
                    else
                        row_scores[r] = scores16(qr, k, live, row_stride, D);
                }
                if (!live) continue;
                for (int r = g0; r < g0 + G; r++) {
                    if (has_next && sub == 0)
                        prefetch_slice((const char *)cache, next, block_size, slots, h0, Hkv, D, elem, run, 2 * r + 1,
                                       2 * rows);
                    correction[r] = softmax16(row_scores[r], live, sm_scale, softcap, m + r, lanes + r, pb + r * SUB,
                                              kscale, vscale);
                }
                pv_group(arow + g0, correction + g0, pb + g0 * SUB, v, live, row_stride, D, G);
            }
        }
    }
    for (int r = 0; r < rows; r++) {  // the denominators summed, the accumulators back in d order
        l[r] += _mm512_cvtss_f32(all_sum(lanes[r]));
        float row[D];
        for (int d = 0; d < D; d++) row[d] = arow[r][chunk_position(d)];
        memcpy(arow[r], row, (size_t)D * sizeof(float));
    }
}

// The two instances, each its own function: inlined into attend_tile side by side, the bf16 one ran ~8% slower.
static __attribute__((noinline)) void walk_bf16(const void *cache, const int64_t *blocks, int kv_lo, int kv_hi,
                                                const int *query_end, int rows, int h0, int hc, int G, int Hkv, int D,
                                                int block_size, float sm_scale, float softcap, float *m, float *l,
                                                float *acc, const uint16_t *qb) {
    walk(cache, NULL, blocks, kv_lo, kv_hi, query_end, rows, h0, hc, G, Hkv, D, block_size, sm_scale, softcap, m, l,
         acc, qb, NULL, 0);
}

#ifdef HAVE_FP8_PATH
// kv16: scratch of 2 * hc * min(SUB, block_size) * D codes
static __attribute__((noinline)) void walk_fp8(const void *cache, const float *scales, const int64_t *blocks,
                                               int kv_lo, int kv_hi, const int *query_end, int rows, int h0, int hc,
                                               int G, int Hkv, int D, int block_size, float sm_scale, float softcap,
                                               float *m, float *l, float *acc, const uint16_t *qb, uint16_t *kv16) {
    walk(cache, scales, blocks, kv_lo, kv_hi, query_end, rows, h0, hc, G, Hkv, D, block_size, sm_scale, softcap, m, l,
         acc, qb, kv16, 1);
}
#endif
#endif

int tm_attention_fp8_path(void) {
#ifdef HAVE_FP8_PATH
    return 1;
#else
    return 0;
#endif
}

// The output row of tile row r: rows are (query, head, group member), r = (qi * hc + hh) * G + g.
static inline int64_t tile_row(int r, int q_first, int h0, int hc, int G, int Hq) {
    const int qi = r / (hc * G), hh = (r / G) % hc, g = r % G;
    return (int64_t)(q_first + qi) * Hq + (h0 + hh) * G + g;
}

// KV heads h0 .. h0 + hc - 1 of one tile of queries over tokens kv_lo .. kv_hi - 1 of a request's cache, query qi
// seeing only those below query_end[qi] (NULL: all). With ``part`` NULL the finished rows go to out / lse; else the
// unnormalized state of each row r goes to part + r * (D + 2): m, l, then the D accumulators (merged with the other
// parts' by merge_parts).
static void attend_tile(const float *q, float *out, float *lse, float *part, const void *cache, const float *scales,
                        int kind, const int64_t *blocks, int kv_lo, int kv_hi, const int *query_end, int q_first,
                        int q_count, int h0, int hc, int Hq, int Hkv, int D, int block_size, float sm_scale,
                        float softcap, int bf16_path, float *kbuf, float *vbuf, float *acc, float *scores,
                        uint16_t *qb) {
    const int G = Hq / Hkv, rows = q_count * hc * G, slots = 2 * Hkv, adim = padded_dim(D);
    float m[TILE_ROWS], l[TILE_ROWS];
    const float *qrow[TILE_ROWS];
    for (int r = 0; r < rows; r++) {
        m[r] = NEG_BIG;
        l[r] = 0.0f;
        qrow[r] = q + tile_row(r, q_first, h0, hc, G, Hq) * D;
        memset(acc + (int64_t)r * adim, 0, (size_t)adim * sizeof(float));
    }
    const int width = hc * D;  // floats of one token's K (or V) heads in the buffers
    const int elem = kind == KIND_F32 ? 4 : kind == KIND_FP8 ? 1 : 2;  // bytes of one cache element
#ifdef HAVE_DPBF16
    if (bf16_path) {
        for (int r = 0; r < rows; r++)  // the rows' bf16 codes (exact: their values are bf16)
            for (int d = 0; d < D; d++) qb[(int64_t)r * D + d] = bf16_round(qrow[r][d]);
#ifdef HAVE_FP8_PATH
        if (scales)  // the widening buffers hold the converted codes (half their bytes at most: see walk)
            walk_fp8(cache, scales, blocks, kv_lo, kv_hi, query_end, rows, h0, hc, G, Hkv, D, block_size, sm_scale,
                     softcap, m, l, acc, qb, (uint16_t *)kbuf);
        else
#endif
            walk_bf16(cache, blocks, kv_lo, kv_hi, query_end, rows, h0, hc, G, Hkv, D, block_size, sm_scale, softcap,
                      m, l, acc, qb);
    } else
#endif
    for (int start = kv_lo - kv_lo % block_size; start < kv_hi; start += block_size) {
        const int skip = kv_lo > start ? kv_lo - start : 0;  // the range starts inside this block
        const int n = (kv_hi - start < block_size ? kv_hi - start : block_size) - skip;
        const int64_t block = blocks[start / block_size];
        for (int t = 0; t < n; t++) {
            const int64_t token = block * block_size + skip + t;
            if (scales) {  // one scale per token and head: widen head by head
                for (int hh = 0; hh < hc; hh++) {
                    const int64_t k_slot = token * slots + h0 + hh, v_slot = k_slot + Hkv;
                    widen(kbuf + (int64_t)t * width + hh * D, cache, k_slot * D, D, kind, scales[k_slot]);
                    widen(vbuf + (int64_t)t * width + hh * D, cache, v_slot * D, D, kind, scales[v_slot]);
                }
            } else {  // the heads are adjacent in the cache: one run each for K and V
                widen(kbuf + (int64_t)t * width, cache, (token * slots + h0) * D, width, kind, 1.0f);
                widen(vbuf + (int64_t)t * width, cache, (token * slots + Hkv + h0) * D, width, kind, 1.0f);
            }
        }
        const int has_next = start + block_size < kv_hi;
        const int64_t next = has_next ? blocks[start / block_size + 1] * block_size : 0;
        for (int r = 0; r < rows; r++) {
            if (has_next)
                prefetch_slice((const char *)cache, next, block_size, slots, h0, Hkv, D, elem, width * elem, r, rows);
            const int hh = (r / G) % hc;
            const int seen = query_end ? query_end[r / (hc * G)] - (start + skip) : n;
            const int live = seen < n ? seen : n;  // of this block's tokens, those row r's query sees
            if (live <= 0) continue;
            float *a = acc + (int64_t)r * adim;
            const float *k = kbuf + hh * D, *v = vbuf + hh * D;
            if (D == 64)
                row_over_block(qrow[r], a, k, v, live, width, 64, sm_scale, softcap, m + r, l + r, scores);
            else if (D == 128)
                row_over_block(qrow[r], a, k, v, live, width, 128, sm_scale, softcap, m + r, l + r, scores);
            else
                row_over_block(qrow[r], a, k, v, live, width, D, sm_scale, softcap, m + r, l + r, scores);
        }
    }
    for (int r = 0; r < rows; r++) {
        const float *a = acc + (int64_t)r * adim;
        if (part) {
            float *p = part + (int64_t)r * (D + 2);
            p[0] = m[r];
            p[1] = l[r];
            memcpy(p + 2, a, (size_t)D * sizeof(float));
            continue;
        }
        const int64_t o = tile_row(r, q_first, h0, hc, G, Hq);
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < D; d++) out[o * D + d] = a[d] * inv;
        if (lse) lse[o] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
    }
}

// The parts' states of one tile (parts blocks of TILE_ROWS * (D + 2) floats, rows as in attend_tile) -> its
// finished rows: out = sum(acc_p e^(m_p - M)) / L, L = sum(l_p e^(m_p - M)), M the largest m_p.
static void merge_parts(const float *state, int parts, int rows, float *out, float *lse, int q_first, int h0, int hc,
                        int G, int Hq, int D) {
    const int64_t stride = (int64_t)TILE_ROWS * (D + 2);
    for (int r = 0; r < rows; r++) {
        float top = NEG_BIG, total = 0.0f;
        for (int p = 0; p < parts; p++) {
            const float mp = state[p * stride + (int64_t)r * (D + 2)];
            top = mp > top ? mp : top;
        }
        const int64_t o = tile_row(r, q_first, h0, hc, G, Hq);
        float *dst = out + o * D;
        memset(dst, 0, (size_t)D * sizeof(float));
        for (int p = 0; p < parts; p++) {
            const float *s = state + p * stride + (int64_t)r * (D + 2);
            const float w = expf(s[0] - top);
            total += s[1] * w;
            for (int d = 0; d < D; d++) dst[d] += s[2 + d] * w;
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int d = 0; d < D; d++) dst[d] *= inv;
        if (lse) lse[o] = total > 0.0f ? top + logf(total) : -INFINITY;
    }
}


#define MIN_PART_BLOCKS 8  // a segment is split into parts of at least this many cache blocks

// Returns 0, or -1 when scratch memory could not be allocated (then some rows are left unwritten). causal: per
// segment, 1 where it is causal (see the top of this file), or NULL where none is.
static int attention(const float *q, float *out, float *lse, const void *cache, const float *scales, int kind,
                     const int64_t *block_tables, int64_t table_stride, const int32_t *req, const int32_t *q_start,
                     const int32_t *q_len, const int32_t *kv_first, const int32_t *kv_len, const int32_t *causal,
                     int num_segments, int Hq, int Hkv, int D, int block_size, float sm_scale, float softcap,
                     int q_bf16, int threads) {
    const int G = Hq / Hkv;
#ifdef HAVE_DPBF16
    // bf16 queries (a bf16 model) over a bf16 cache, or over an fp8 one where the build has the byte lookups
    const int bf16_path = q_bf16 && D % 16 == 0 && ((kind == KIND_BF16 && !scales)
#ifdef HAVE_FP8_PATH
                                                    || (kind == KIND_FP8 && scales)
#endif
                                                    );
#else
    const int bf16_path = 0;
    (void)q_bf16;
#endif
    // A work item sweeps hc adjacent KV heads of its queries over a part of their cache: the most heads that keep
    // a tile's rows within TILE_ROWS and one token's K run within 256 floats (the widened block stays in L1), so
    // the cache is read in long runs.
    int hc = 1;
    for (int c = Hkv; c > 1; c--)
        if (Hkv % c == 0 && c * G <= TILE_ROWS && c * D <= 256) {
            hc = c;
            break;
        }
    const int tile_queries = TILE_ROWS / (G * hc) > 0 ? TILE_ROWS / (G * hc) : 1;
    const int head_groups = Hkv / hc;
    // Work items: (segment, query tile, head group, part), numbered through the prefix sums below. Too few of them
    // for the threads (one long decode: a few heads) -> segments are split along their cache into parts of at
    // least MIN_PART_BLOCKS blocks, merged afterwards.
    int64_t base = 0;
    for (int s = 0; s < num_segments; s++)
        base += (int64_t)head_groups * ((q_len[s] + tile_queries - 1) / tile_queries);
    const int64_t wanted = 4 * (int64_t)threads;
    const int split = threads > 1 && base > 0 && base < wanted ? (int)((wanted + base - 1) / base) : 1;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(2 * num_segments + 2));
    int *parts = malloc(sizeof(int) * (size_t)(num_segments + 1));
    if (!first || !parts) {
        free(first);
        free(parts);
        return -1;
    }
    int64_t *state_at = first + num_segments + 1;  // float offset of a split segment's part states
    int64_t total = 0, states = 0;
    for (int s = 0; s < num_segments; s++) {
        const int blocks = kv_len[s] > kv_first[s]
                               ? (kv_len[s] - 1) / block_size - kv_first[s] / block_size + 1 : 0;
        const int most = blocks / MIN_PART_BLOCKS;
        parts[s] = split < most ? split : (most > 1 ? most : 1);
        const int64_t tiles = (q_len[s] + tile_queries - 1) / tile_queries;
        first[s] = total;
        total += head_groups * tiles * parts[s];
        state_at[s] = states;
        if (parts[s] > 1) states += head_groups * tiles * parts[s] * (int64_t)TILE_ROWS * (D + 2);
    }
    first[num_segments] = total;
    float *state = states ? malloc(sizeof(float) * (size_t)states) : NULL;
    int failed = states && !state;
    const size_t width = (size_t)hc * D;
#pragma omp parallel num_threads(threads) if (!failed)
    {
        // kbuf, vbuf, acc, scores (floats), then the bf16 path's query codes
        const size_t accs = (size_t)TILE_ROWS * padded_dim(D), floats = 2 * block_size * width + accs + block_size;
        float *scratch = malloc(sizeof(float) * floats + sizeof(uint16_t) * (size_t)TILE_ROWS * D);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        int s = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < total; item++) {
            if (!scratch || failed) continue;
            while (first[s + 1] <= item) s++;
            while (first[s] > item) s--;
            const int64_t local = item - first[s];
            const int part = (int)(local % parts[s]), group = (int)(local / parts[s]);
            const int h0 = (group % head_groups) * hc, tile = group / head_groups;
            const int q0 = tile * tile_queries;
            const int count = q_len[s] - q0 < tile_queries ? q_len[s] - q0 : tile_queries;
            int lo = kv_first[s], hi = kv_len[s];
            int ends[TILE_ROWS];  // a causal segment's queries: where each one's tokens end
            const int is_causal = causal && causal[s];
            if (is_causal) {
                for (int qi = 0; qi < count; qi++) ends[qi] = kv_len[s] - q_len[s] + q0 + qi + 1;
            }
            float *state_out = NULL;
            if (parts[s] > 1) {  // whole blocks: part p takes blocks [b0 + p * nb / parts, b0 + (p + 1) * nb / parts)
                const int b0 = kv_first[s] / block_size, nb = (kv_len[s] - 1) / block_size - b0 + 1;
                const int from = (b0 + (int)((int64_t)part * nb / parts[s])) * block_size;
                const int to = (b0 + (int)((int64_t)(part + 1) * nb / parts[s])) * block_size;
                lo = from > lo ? from : lo;
                hi = to < hi ? to : hi;
                state_out = state + state_at[s] + local * (int64_t)TILE_ROWS * (D + 2);
            }
            if (is_causal && ends[count - 1] < hi) hi = ends[count - 1];  // no query of the tile sees further
            float *kbuf = scratch, *vbuf = kbuf + block_size * width, *acc = vbuf + block_size * width;
            attend_tile(q, out, lse, state_out, cache, scales, kind, block_tables + (int64_t)req[s] * table_stride, lo,
                        hi, is_causal ? ends : NULL, q_start[s] + q0, count, h0, hc, Hq, Hkv, D, block_size, sm_scale,
                        softcap, bf16_path, kbuf, vbuf, acc, acc + accs, (uint16_t *)(scratch + floats));
        }
        if (states) {  // the split segments' tiles, each merged from its parts (after the loop's barrier)
#pragma omp for schedule(dynamic, 1)
            for (int t = 0; t < num_segments; t++) {
                if (parts[t] == 1 || failed) continue;
                const int64_t groups = (first[t + 1] - first[t]) / parts[t];
                for (int64_t group = 0; group < groups; group++) {
                    const int h0 = (int)(group % head_groups) * hc, q0 = (int)(group / head_groups) * tile_queries;
                    const int count = q_len[t] - q0 < tile_queries ? q_len[t] - q0 : tile_queries;
                    merge_parts(state + state_at[t] + group * parts[t] * (int64_t)TILE_ROWS * (D + 2), parts[t],
                                count * hc * G, out, lse, q_start[t] + q0, h0, hc, G, Hq, D);
                }
            }
        }
        free(scratch);
    }
    free(state);
    free(parts);
    free(first);
    return failed ? -1 : 0;
}

int tm_paged_attention(const float *q, float *out, float *lse, const void *cache, const float *scales, int kind,
                       const int64_t *block_tables, int64_t table_stride, const int32_t *req, const int32_t *q_start,
                       const int32_t *q_len, const int32_t *kv_first, const int32_t *kv_len, int num_segments, int Hq,
                       int Hkv, int D, int block_size, float sm_scale, float softcap, int q_bf16, int threads) {
    return attention(q, out, lse, cache, scales, kind, block_tables, table_stride, req, q_start, q_len, kv_first,
                     kv_len, NULL, num_segments, Hq, Hkv, D, block_size, sm_scale, softcap, q_bf16, threads);
}

// bf16 [n] -> float32 (exact). (Here, not in quant_linear.c: benchmarks/attention_revisions.py builds this file
// alone.)
void tm_widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(dst + i, &bits, 4);
    }
}

// src [n] float32 -> bf16, rounded to nearest even (a NaN stays a NaN), as torch's .to(torch.bfloat16).
void tm_round_bf16(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, src + i, 4);
        dst[i] = (bits & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)((bits >> 16) | 0x40)
                                                    : (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    }
}


// tm_paged_attention_bf16 and tm_paged_attention_f32: rows of q (row t's [Hq][D] at q + t * q_stride elements, bf16 or
// float32) into out [rows][Hq][D] of the same dtype. Only the segments' rows are widened / copied and rounded (the
// decodes beside a step's prefill chunks, whose rows another kernel fills, are a few of its rows: widening, zeroing
// and rounding them all cost more than the decodes' attention); the others come out zero.
static int attention_of_rows(const void *q, int64_t q_stride, void *out, int64_t rows, int bf16, const void *cache,
                             const float *scales, int kind, const int64_t *block_tables, int64_t table_stride,
                             const int32_t *req, const int32_t *q_start, const int32_t *q_len,
                             const int32_t *kv_first, const int32_t *kv_len, const int32_t *causal, int num_segments,
                             int Hq, int Hkv, int D, int block_size, float sm_scale, float softcap, int threads) {
    const int64_t width = (int64_t)Hq * D, n = rows * width;
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    // q's rows as float32 [rows][Hq][D], then (bf16) the float32 output
    float *buffer = malloc(sizeof(float) * (size_t)((bf16 ? 2 : 1) * n + 1));
    uint8_t *covered = calloc((size_t)rows + 1, 1);
    if (!buffer || !covered) {
        free(buffer);
        free(covered);
        return -1;
    }
    for (int s = 0; s < num_segments; s++)
        for (int64_t t = q_start[s]; t < (int64_t)q_start[s] + q_len[s]; t++) {
            if (bf16)
                tm_widen_bf16((const uint16_t *)q + t * q_stride, buffer + t * width, width);
            else
                memcpy(buffer + t * width, (const float *)q + t * q_stride, sizeof(float) * (size_t)width);
            covered[t] = 1;
        }
    float *result = bf16 ? buffer + n : out;
    const int code = attention(buffer, result, NULL, cache, scales, kind, block_tables, table_stride, req, q_start,
                               q_len, kv_first, kv_len, causal, num_segments, Hq, Hkv, D, block_size, sm_scale, softcap,
                               bf16, threads);
    if (code == 0)
        for (int64_t t = 0; t < rows; t++) {
            if (!covered[t])  // rows no segment covers come out zero, not garbage
                memset((char *)out + (size_t)(t * width) * elem, 0, elem * (size_t)width);
            else if (bf16)  // every covered row's output is written whole (a query that sees no token: zeros)
                tm_round_bf16(result + t * width, (uint16_t *)out + t * width, width);
        }
    free(buffer);
    free(covered);
    return code;
}

// tm_paged_attention over bf16 queries into bf16 out [rows][Hq][D] (no lse), with causal segments (causal: per
// segment, or NULL): a bf16 model's step (decodes, and prefill chunks whose own tokens are in the cache), with no
// conversion of its own; rows no segment covers come out zero (a prefill kernel's to fill). Other arguments as there;
// the same returns.
int tm_paged_attention_bf16(const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t rows, const void *cache,
                            const float *scales, int kind, const int64_t *block_tables, int64_t table_stride,
                            const int32_t *req, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_first,
                            const int32_t *kv_len, const int32_t *causal, int num_segments, int Hq, int Hkv, int D,
                            int block_size, float sm_scale, float softcap, int threads) {
    return attention_of_rows(q, q_stride, out, rows, 1, cache, scales, kind, block_tables, table_stride, req, q_start,
                             q_len, kv_first, kv_len, causal, num_segments, Hq, Hkv, D, block_size, sm_scale, softcap,
                             threads);
}

// The same over float32 queries into float32 out: a float32 model's decode step from the layer stack
// (kernels/cpu/decoder.c), its q rows read inside the step's fused q/k/v rows.
int tm_paged_attention_f32(const float *q, int64_t q_stride, float *out, int64_t rows, const void *cache,
                           const float *scales, int kind, const int64_t *block_tables, int64_t table_stride,
                           const int32_t *req, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_first,
                           const int32_t *kv_len, const int32_t *causal, int num_segments, int Hq, int Hkv, int D,
                           int block_size, float sm_scale, float softcap, int threads) {
    return attention_of_rows(q, q_stride, out, rows, 0, cache, scales, kind, block_tables, table_stride, req, q_start,
                             q_len, kv_first, kv_len, causal, num_segments, Hq, Hkv, D, block_size, sm_scale, softcap,
                             threads);
}
