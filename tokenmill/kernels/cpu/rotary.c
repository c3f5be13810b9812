// Rotary position embeddings of a step's queries and keys on a CPU, both in one call (one parallel region).
//
// kernels/rotary.py holds the dispatch; models/layers/rotary.py's RotaryEmbedding.apply is the reference. Layout:
// the neox / HF ``rotate_half`` pairs (i, i + rot / 2) of each head's first ``rot`` features; features from rot on
// are copied as they are. Each output is computed in float32 from the exact widening of its inputs and rounded once
// (to nearest even, for bf16): the reference's x1 * cos - x2 * sin to a float32 ulp (the build may fuse the multiply
// and the subtraction). Inductor's code for the reference (its gather of the cos / sin rows by position kept parts of
// it in scalar loops) took 405 us a layer at 2,048 tokens of SmolLM2 on a Zen 4, this kernel 264 us
// (benchmarks/cpu_elementwise.py).
//
// Work: (token, head) rows of q then k, spread over the threads where there are enough to pay for a parallel region.
// In place is allowed (out = x: each pair is read before it is written, and no other row's), how the fused qkv
// projection's output is rotated where it lies (kernels/rotary.py rope_qk_inplace).

#include <stdint.h>
#include <string.h>

#include "simd_common.h"

#define MIN_PARALLEL 8192  // fewer elements than this run on the calling thread

static void row_f32(const float *x, float *out, const float *restrict c, const float *restrict s,
                    int64_t half, int64_t rot, int64_t D) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        out[i] = a * c[i] - b * s[i];
        out[i + half] = b * c[i] + a * s[i];
    }
    if (rot < D && out != x) memcpy(out + rot, x + rot, (size_t)(D - rot) * sizeof(float));
}

static void row_bf16(const uint16_t *x, uint16_t *out, const float *restrict c,
                     const float *restrict s, int64_t half, int64_t rot, int64_t D) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = tm_bf16_value(x[i]), b = tm_bf16_value(x[i + half]);
        out[i] = tm_bf16_bits(a * c[i] - b * s[i]);
        out[i + half] = tm_bf16_bits(b * c[i] + a * s[i]);
    }
    if (rot < D && out != x) memcpy(out + rot, x + rot, (size_t)(D - rot) * sizeof(uint16_t));
}

// q: token t's head h at q + t * q_tok + h * q_head (elements; a head's D features contiguous), Hq heads; k alike.
// -> q_out, k_out: token t's head h at q_out + t * q_out_tok + h * D (k_out alike); q_out = q, k_out = k with the
// same strides (q_head = k_head = D) rotates in place. cos, sin [positions][rot / 2] float32; positions [T].
// bf16 = 1: q, k and the outputs are bf16 (uint16 bits); 0: float32. rot even, 0 < rot <= D. Returns 0, or -1
// (nothing written) where a position is outside the table's num_positions rows.
int tm_rope_qk(const void *q, int64_t q_tok, int64_t q_head, int64_t Hq, const void *k, int64_t k_tok,
               int64_t k_head, int64_t Hk, void *q_out, void *k_out, int64_t q_out_tok, int64_t k_out_tok, int64_t T,
               int64_t D, int64_t rot,
               const int64_t *positions, int64_t num_positions, const float *cos, const float *sin, int bf16,
               int threads) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    const int64_t H = Hq + Hk, half = rot / 2, rows = T * H;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * D >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / H, h = r % H, is_q = h < Hq, hh = is_q ? h : h - Hq;
        const int64_t in = is_q ? t * q_tok + hh * q_head : t * k_tok + hh * k_head;
        const int64_t at = is_q ? t * q_out_tok + hh * D : t * k_out_tok + hh * D;
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
        if (bf16)
            row_bf16((const uint16_t *)(is_q ? q : k) + in, (uint16_t *)(is_q ? q_out : k_out) + at, c, s, half, rot,
                     D);
        else
            row_f32((const float *)(is_q ? q : k) + in, (float *)(is_q ? q_out : k_out) + at, c, s, half, rot, D);
    }
    return 0;
}
