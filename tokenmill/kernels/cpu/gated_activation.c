// The gated activation of a SwiGLU MLP on a CPU: out = silu(gate) * up, over a fused projection's rows [gate | up].
//
// kernels/gated_activation.py holds the dispatch and the PyTorch reference. Each element is computed in float32 from
// the exact widening of its inputs and rounded once (to nearest even, for bf16): what inductor's fused code for
// F.silu(gate) * up computes, to a few float32 ulps (e^x here is a polynomial, not libm's). Inductor's own version of
// this loop ran at ~5 cycles an element on a Zen 4 (its exp and division); a prefill of 2,048 tokens spent 75 ms of
// 1.3 s in it on SmolLM2.
//
// Work: rows x inter outputs, cut into spans of SPAN outputs of one row (spans never cross rows), spread over the
// threads when there are enough of them to pay for a parallel region.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_common.h"

#define SPAN 512          // outputs of one row a work item covers
#define MIN_PARALLEL 8192 // fewer outputs than this run on the calling thread

// e^-g held below e^87, as the vector loop's: no inf / inf (the build assumes finite math)
static inline float silu_times(float g, float u) { return g / (1.0f + expf(fminf(-g, 87.0f))) * u; }

static void span_f32(const float *gate, const float *up, float *out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = silu_times(gate[i], up[i]);
}

static void span_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(gate + i))), 16));
        const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(up + i))), 16));
        // e^-g, its exponent held below 88 (e^88 would overflow into inf / inf below; silu is ~0 there anyway)
        const __m512 e = tm_exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(87.0f)));
        // 1 / (1 + e): the approximate reciprocal and one Newton step (relative error ~2^-28)
        const __m512 d = _mm512_add_ps(one, e);
        __m512 r = _mm512_rcp14_ps(d);
        r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, r), u);
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(y));  // nearest even, NaN quieted
#else
        // round to nearest even in integer lanes (exact for finite values; NaN is kept a NaN below)
        const __m512i bits = _mm512_castps_si512(y);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                                            16);
        const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
        rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16),
                                                                       _mm512_set1_epi32(0x40)));
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(rounded));
#endif
    }
#endif
    for (; i < n; i++) out[i] = tm_bf16_bits(silu_times(tm_bf16_value(gate[i]), tm_bf16_value(up[i])));
}

// gu [rows][gu_stride] (elements; gate at columns 0 .. inter - 1, up at inter .. 2 inter - 1) -> out [rows][inter],
// contiguous. bf16 = 1: both bf16 (as uint16 bits); 0: float32.
void tm_silu_mul(const void *gu, int64_t gu_stride, void *out, int64_t rows, int64_t inter, int bf16, int threads) {
    const int64_t spans_per_row = (inter + SPAN - 1) / SPAN, spans = rows * spans_per_row;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * inter >= MIN_PARALLEL)
    for (int64_t s = 0; s < spans; s++) {
        const int64_t r = s / spans_per_row, i0 = (s % spans_per_row) * SPAN;
        const int64_t n = inter - i0 < SPAN ? inter - i0 : SPAN;
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gu + r * gu_stride + i0;
            span_bf16(g, g + inter, (uint16_t *)out + r * inter + i0, n);
        } else {
            const float *g = (const float *)gu + r * gu_stride + i0;
            span_f32(g, g + inter, (float *)out + r * inter + i0, n);
        }
    }
}
