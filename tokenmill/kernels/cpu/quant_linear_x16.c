// int4 / int8 weights x int8 activations over a weight repacked once at load so that the int32 lanes of a register are
// output rows: the products of a 32-input block add up in integers, and the float work (widen, scale, min term) is
// one register per block for 8 or 16 outputs, with no horizontal sums. Two builds of one layout:
// - AVX-512 VNNI (vpdpbusd): a register is a whole tile of 16 rows;
// - AVX2 (vpmaddubsw): a register is half a tile (rows 0..7, then rows 8..15), and int8 codes go back to signed
//   (code - 128) with their sign moved onto x, as quant_linear.c does, since u8 * s8 pairs of + 128 codes would
//   saturate vpmaddubsw's int16 sums.
//
// Same formats and arithmetic as quant_linear.c (see its header): activations quantized per 32-input block (codes xq,
// scale xd, xs = xd * sum of codes); out = sum over blocks of (scale * xd) * (codes . xq) + min * xs.
//
// The interleaved layout ("x16", written by kernels/quant_linear.py's repack_x16; rows padded to a multiple of 16
// with zero codes and scales): for each tile of 16 output rows, each block b, each step s of 4 inputs (0..7):
//   int4: 32 bytes; byte 4i + c holds input 32b + 4s + c of row i in its low nibble (i < 8) and of row i + 8 in its
//         high nibble, so the low nibbles are lanes 0..7 of vpdpbusd's operand and the high ones lanes 8..15;
//   int8: 64 bytes; byte 4i + c holds code + 128 (unsigned) of row i, input 32b + 4s + c. The 128 * sum(x codes)
//         this adds is taken back through the min term: min' = min - 128 * scale (sum(x codes) is in xs).
// d, m: [tiles][groups][16] scales and mins of each group of G inputs (G a multiple of 32), fp16 or float32.
//
// Symmetric weights (``symmetric``, set at load: int4 whose every min is -8 * scale, as GGUF's Q4_0; int8 without
// mins) leave out the min term: out = sum over blocks of (scale * xd) * (codes . xq - offset * xsum), xsum the block's
// sum of x codes, taken off in integers; offset 8 for int4, 128 for the VNNI build's int8 (the layout's + 128), 0 for
// the AVX2 build's (its codes are signed again). Two float multiplies a block and row remain beside the eight
// vpdpbusd, where the min term made three; on a Zen 4 they contend with vpdpbusd (BENCHMARKS.md, issue 24, "Symmetric
// weights' zero point in integers").
//
// A third build on hosts with AMX (tiles of bf16 products, Sapphire Rapids and later), for calls of amx_from_rows rows
// and more (set per weight by a start-up measurement; 0: never): each tile of 16 output rows is widened once per call
// to bf16 weights (q * scale + min in float32, rounded to nearest even: what a bf16 copy of the dequantized weight
// holds) and meets x rounded to bf16 (the model's own dtype on a CPU) in tile products summed in float32 over all of
// K. The integer kernels' work grows with the rows; a tile product does 16 x rows x 16 outputs x 32 inputs at once,
// and the widening is paid once per call whatever the rows.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "simd_common.h"

typedef struct {
    const uint8_t *q;
    const void *d, *m;  // m: NULL where the format has no mins
    int64_t K, N, G;
    int32_t kind;  // 0: int4, 1: int8
    int32_t d_f32, m_f32;
    int32_t amx_from_rows;  // calls of this many rows and more take the AMX build, where there is one (0: never)
    int32_t symmetric;      // 1: w = scale * (q - 8) (int4) or scale * q (int8, no mins); see above
} tm_x16_weight;

// One call's activations as tm_quantize_blocks writes them: codes q [M][K]; per 32-input block d (the scale) and s
// (d * the codes' sum), [M][K / 32] each; for a symmetric weight, start: -offset * the codes' sum (where a block's
// integer dot product starts), likewise (NULL where zero_point is 0).
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *start;
} x_codes;

int tm_alloc_codes(int64_t M, int64_t K, int8_t **xq, float **xd, float **xs, int32_t **xsum);  // quant_linear.c
void tm_quantize_blocks(const void *x, int x_bf16, int64_t i0, int64_t i1, int8_t *xq, float *xd,  // quant_linear.c
                        float *xs, int32_t *xsum);
void *tm_thread_scratch(int64_t bytes);                                                         // quant_linear.c
void tm_round_bf16(const float *src, uint16_t *dst, int64_t n);                                 // paged_attention.c

// Tiles ahead of the one being computed whose bytes a call asks for (see prefetch_block). On a Zen 5 at 1-128 rows
// 2 ran 0.93-1.09x as fast as 1 and 4 or 8 slower (benchmarks/x16_builds.py --cold-mb; -DPREFETCH_TILES=N through
// TOKENMILL_CPU_KERNEL_FLAGS builds another distance).
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 1
#endif

// Block b's share of tile t's bytes asked into the L1: its codes (4 or 8 lines) and line b of the tile's scales and of
// its mins. Each block of the tile being computed asks for the same block of tile t + PREFETCH_TILES, so that a tile's
// loads from memory overlap the work of the one before it. A decode-sized call reads its weight once, from memory in
// a served step (the model's weights and the KV cache pass through the L3 between two calls of a layer), and left to
// the hardware prefetcher alone such calls ran 1.1-1.9x slower (BENCHMARKS.md, issue 24, "Memory asked for
// ahead"). (As asm: GCC 12 drops __builtin_prefetch in some of these loops; see paged_attention.c.)
static inline __attribute__((always_inline)) void prefetch_block(const tm_x16_weight *w, int64_t t, int64_t b) {
#if defined(__x86_64__)
    const int64_t blocks = w->K / 32, step_bytes = w->kind == 0 ? 32 : 64, groups = (w->K + w->G - 1) / w->G;
    const char *q = (const char *)(w->q + (t * blocks + b) * 8 * step_bytes);
    for (int64_t off = 0; off < 8 * step_bytes; off += 64) __asm__ volatile("prefetcht0 %0" : : "m"(q[off]));
    const int64_t d_bytes = groups * 16 * (w->d_f32 ? 4 : 2), m_bytes = groups * 16 * (w->m_f32 ? 4 : 2);
    if (64 * b < d_bytes) __asm__ volatile("prefetcht0 %0" : : "m"(((const char *)w->d)[t * d_bytes + 64 * b]));
    if (w->m && 64 * b < m_bytes)
        __asm__ volatile("prefetcht0 %0" : : "m"(((const char *)w->m)[t * m_bytes + 64 * b]));
#else
    (void)w; (void)t; (void)b;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TM_VNNI 1
#include <immintrin.h>

#define TILE_M 8  // rows of x a tile keeps in registers (with the 8 unpacked steps of a block)

typedef int32_t x4_t __attribute__((may_alias, aligned(1)));  // 4 int8 codes of x read as one word

static inline __m512 load16(const void *p, int64_t i, int f32) {
    return f32 ? _mm512_loadu_ps((const float *)p + i)
               : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
}

// The bf16 of each float32 lane, rounded to nearest even (a NaN stays a NaN): tm_round_bf16's arithmetic, 16 lanes.
static inline __m512i round_bf16_lanes(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

// Step s of an int4 block (its 32 bytes at qb + 32 s) as vpdpbusd's unsigned operand: dword n holds row n's 4 codes
// (rows 0..7 from the low nibbles, 8..15 from the high ones; see the layout above).
static inline __m512i int4_step(const uint8_t *qb, int s) {
    const __m512i z = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qb + 32 * s)));
    return _mm512_and_si512(_mm512_srlv_epi64(z, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)), _mm512_set1_epi8(0x0F));
}

// The lanes of the output tile at column n0 that exist (fewer than 16 only in a last tile of N).
static inline __mmask16 tile_lanes(const tm_x16_weight *w, int64_t n0) {
    return w->N - n0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (w->N - n0)) - 1);
}

// v into out's row ``row``, columns n0 .. (the ``live`` lanes): float32, or bf16 where out_bf16 (rounded to nearest
// even, as tm_round_bf16 rounds the float32 result).
static inline void store_lanes(void *out, int out_bf16, const tm_x16_weight *w, int64_t row, int64_t n0,
                               __mmask16 live, __m512 v) {
    if (out_bf16)
        _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)out + row * w->N + n0, live, round_bf16_lanes(v));
    else
        _mm512_mask_storeu_ps((float *)out + row * w->N + n0, live, v);
}

// out[m0 + r][16 t ..] for r < MR, plus bias (NULL: none); out float32, or bf16 where out_bf16 (rounded to nearest
// even, as tm_round_bf16 rounds the float32 result).
static inline __attribute__((always_inline)) void x16_tile(const tm_x16_weight *w, int64_t t, int64_t m0,
                                                           const int MR, const int sym, const x_codes *x,
                                                           const float *bias, void *out, int out_bf16, int64_t pf) {
    const int64_t blocks = w->K / 32, per_group = w->G / 32, groups = (w->K + w->G - 1) / w->G;
    const int64_t step_bytes = w->kind == 0 ? 32 : 64;
    const uint8_t *qt = w->q + t * blocks * 8 * step_bytes;
    const int8_t *xq = x->q;
    const float *xd = x->d, *xs = x->s;
    __m512 acc[TILE_M];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (pf >= 0) prefetch_block(w, pf, b);
        __m512i steps[8];
        const uint8_t *qb = qt + b * 8 * step_bytes;
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            steps[s] = w->kind == 0 ? int4_step(qb, s) : _mm512_loadu_si512((const void *)(qb + 64 * s));
        }
        const int64_t at = (t * groups + b / per_group) * 16;
        const __m512 d = load16(w->d, at, w->d_f32);
        __m512 m = _mm512_setzero_ps();
        if (!sym) {
            if (w->m) m = load16(w->m, at, w->m_f32);
            if (w->kind == 1) m = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), m);
        }
        // Steps outer, rows inner: each row's 8 products form a chain of dependent vpdpbusd, and taken a row at a time
        // (as this loop once did) the chains' latency, not the core's throughput, set the pace (1.03-1.1x slower at
        // 4-32 rows, Zen 4). x's 4 codes of a step are broadcast straight from memory (a load; copied out through
        // general registers first, GCC 12 spent a shift, a move and a broadcast per step).
        __m512i dot[TILE_M];
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++)
            dot[r] = sym ? _mm512_set1_epi32(x->start[(m0 + r) * blocks + b]) : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) {
                const x4_t *xb = (const x4_t *)(xq + (m0 + r) * w->K + 32 * b);
                dot[r] = _mm512_dpbusd_epi32(dot[r], steps[s], _mm512_set1_epi32(xb[s]));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const int64_t xi = (m0 + r) * blocks + b;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(xd[xi])), acc[r]);
            if (!sym) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[xi]), acc[r]);
        }
    }
    const int64_t n0 = 16 * t;
    const __mmask16 live = tile_lanes(w, n0);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        const __m512 v = bias ? _mm512_add_ps(acc[r], b) : acc[r];
        store_lanes(out, out_bf16, w, m0 + r, n0, live, v);
    }
}

// Tiles computed together, and the rows of x they keep in registers (4 x 3 dot products and accumulators): each of
// x's 4-code broadcasts then feeds GROUP_T vpdpbusd, where a lone tile spends a load on each. Prompts take groups in
// every chunk; decode-sized calls (one chunk) from GROUP_FROM_ROWS rows on, int4 weights only. On a Zen 5, from memory
// (x16_builds.py --cold-mb 96), against the lone tile: int4 1.00-1.09x at 32 rows, 1.03-1.12x at 64-128, 1.05-1.14x
// at 256-2,048; 0.87-1.01x at 8-16 rows, where the weight's bytes, not the loads, set the pace. int8 1.07-1.23x at
// 256-2,048, but 0.86-0.92x at 32 rows (the LM head: a group and the next one's bytes asked for overflow the L1;
// asking into the L2 instead did no better). 7 rows x 2 tiles ran about as fast as 4 x 3, 3 x 4 slower.
#ifndef GROUP_M
#define GROUP_M 4
#endif
#ifndef GROUP_T
#define GROUP_T 3
#endif
#ifndef GROUP_FROM_ROWS
#define GROUP_FROM_ROWS 32
#endif

// x16_tile over tiles t .. t + NT - 1 at once, for MR <= GROUP_M rows; steps unpacked as they are used (NT tiles'
// 8 steps would not fit in the registers beside the rows'). Where ``prefetch`` (a literal at each call: the loop is
// compiled out of the other instance, where its mere presence cost gate_up 1.1-1.2x at 2,048 rows), each block asks for
// the same block of tiles pf .. pf_end - 1 (none where pf_end <= pf): the next group's, on a first pass over the rows.
static inline __attribute__((always_inline)) void x16_group(const tm_x16_weight *w, int64_t t, int64_t m0,
                                                            const int MR, const int NT, const int sym,
                                                            const x_codes *x, const float *bias, void *out,
                                                            int out_bf16, const int prefetch, int64_t pf,
                                                            int64_t pf_end) {
    const int64_t blocks = w->K / 32, per_group = w->G / 32, groups = (w->K + w->G - 1) / w->G;
    const int64_t step_bytes = w->kind == 0 ? 32 : 64, tile_bytes = blocks * 8 * step_bytes;
    const uint8_t *qt = w->q + t * tile_bytes;
    const int8_t *xq = x->q;
    const float *xd = x->d, *xs = x->s;
    __m512 acc[GROUP_T][GROUP_M];
#pragma GCC unroll 8
    for (int j = 0; j < NT; j++)
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) acc[j][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (prefetch)
            for (int64_t u = pf; u < pf_end; u++) prefetch_block(w, u, b);
        const uint8_t *qb = qt + b * 8 * step_bytes;
        __m512i dot[GROUP_T][GROUP_M];
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const __m512i start = sym ? _mm512_set1_epi32(x->start[(m0 + r) * blocks + b]) : _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int j = 0; j < NT; j++) dot[j][r] = start;
        }
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            __m512i wj[GROUP_T];
#pragma GCC unroll 8
            for (int j = 0; j < NT; j++)
                wj[j] = w->kind == 0 ? int4_step(qb + j * tile_bytes, s)
                                     : _mm512_loadu_si512((const void *)(qb + j * tile_bytes + 64 * s));
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) {
                const __m512i xb = _mm512_set1_epi32(((const x4_t *)(xq + (m0 + r) * w->K + 32 * b))[s]);
#pragma GCC unroll 8
                for (int j = 0; j < NT; j++) dot[j][r] = _mm512_dpbusd_epi32(dot[j][r], wj[j], xb);
            }
        }
        const int64_t at = (t * groups + b / per_group) * 16;
        __m512 d[GROUP_T], mn[GROUP_T];
#pragma GCC unroll 8
        for (int j = 0; j < NT; j++) {
            d[j] = load16(w->d, at + j * groups * 16, w->d_f32);
            mn[j] = _mm512_setzero_ps();
            if (!sym) {
                if (w->m) mn[j] = load16(w->m, at + j * groups * 16, w->m_f32);
                if (w->kind == 1) mn[j] = _mm512_fnmadd_ps(d[j], _mm512_set1_ps(128.0f), mn[j]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const int64_t xi = (m0 + r) * blocks + b;
            const __m512 scale = _mm512_set1_ps(xd[xi]), sum = _mm512_set1_ps(sym ? 0.0f : xs[xi]);
#pragma GCC unroll 8
            for (int j = 0; j < NT; j++) {
                acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][r]), _mm512_mul_ps(d[j], scale), acc[j][r]);
                if (!sym) acc[j][r] = _mm512_fmadd_ps(mn[j], sum, acc[j][r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NT; j++) {
        const int64_t n0 = 16 * (t + j);
        const __mmask16 live = tile_lanes(w, n0);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(live, bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const __m512 v = bias ? _mm512_add_ps(acc[j][r], bv) : acc[j][r];
            store_lanes(out, out_bf16, w, m0 + r, n0, live, v);
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TM_X16_AVX2 1
#include <immintrin.h>

#define TILE_M 4  // rows of x a half tile keeps in registers (int16 sums and float accumulators)

static inline __m256 load8(const void *p, int64_t i, int f32) {
    return f32 ? _mm256_loadu_ps((const float *)p + i)
               : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}

// out[m0 + r][16 t + 8 half ..] for r < MR, plus bias (NULL: none), float32 or bf16 (out_bf16): one half tile (8
// rows) over every block.
static inline __attribute__((always_inline)) void x16_half(const tm_x16_weight *w, int64_t t, int half, int64_t m0,
                                                           const int MR, const int sym, const x_codes *x,
                                                           const float *bias, void *out, int out_bf16, int64_t pf) {
    const int8_t *xq = x->q;
    const float *xd = x->d, *xs = x->s;
    const int64_t blocks = w->K / 32, per_group = w->G / 32, groups = (w->K + w->G - 1) / w->G;
    const int64_t step_bytes = w->kind == 0 ? 32 : 64;
    const uint8_t *qt = w->q + t * blocks * 8 * step_bytes + (w->kind == 0 ? 0 : 32 * half);
    const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[TILE_M];
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (pf >= 0) prefetch_block(w, pf, b);
        const uint8_t *qb = qt + b * 8 * step_bytes;
        __m256i dot[TILE_M];
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) dot[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qb + step_bytes * s));
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++) {
                int32_t x4;
                memcpy(&x4, xq + (m0 + r) * w->K + 32 * b + 4 * s, 4);
                const __m256i xv = _mm256_set1_epi32(x4);
                if (w->kind == 0) {  // u8 codes <= 15: 8 steps of pair sums stay within int16 (8 * 2 * 15 * 127)
                    const __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, nibble);
                    dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(q, xv));
                } else {  // signed codes: |code| as u8, its sign onto x; each step's pair sums widened to int32
                    const __m256i q = _mm256_xor_si256(v, flip);
                    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
                    dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(p, ones));
                }
            }
        }
        const int64_t at = (t * groups + b / per_group) * 16 + 8 * half;
        const __m256 d = load8(w->d, at, w->d_f32);
        const __m256 m = !sym && w->m ? load8(w->m, at, w->m_f32) : _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) {
            const int64_t xi = (m0 + r) * blocks + b;
            __m256i sums = w->kind == 0 ? _mm256_madd_epi16(dot[r], ones) : dot[r];
            if (sym && w->kind == 0)  // (int8's offset here is 0: its codes are signed again)
                sums = _mm256_add_epi32(sums, _mm256_set1_epi32(x->start[xi]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(xd[xi])), acc[r]);
            if (!sym) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[xi]), acc[r]);
        }
    }
    const int64_t n0 = 16 * t + 8 * half, live = w->N - n0 < 8 ? w->N - n0 : 8;
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) {
        const int64_t at = (m0 + r) * w->N + n0;
        if (live == 8 && !bias && !out_bf16) {
            _mm256_storeu_ps((float *)out + at, acc[r]);
        } else if (live > 0) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r]);
            if (bias)
                for (int i = 0; i < live; i++) lanes[i] += bias[n0 + i];
            if (out_bf16)
                tm_round_bf16(lanes, (uint16_t *)out + at, live);
            else
                memcpy((float *)out + at, lanes, sizeof(float) * (size_t)live);
        }
    }
}

// Both halves of tile t (the second reads the tile's bytes from cache; the first asks for tile pf's, -1: none).
static inline __attribute__((always_inline)) void x16_tile(const tm_x16_weight *w, int64_t t, int64_t m0,
                                                           const int MR, const int sym, const x_codes *x,
                                                           const float *bias, void *out, int out_bf16, int64_t pf) {
    x16_half(w, t, 0, m0, MR, sym, x, bias, out, out_bf16, pf);
    x16_half(w, t, 1, m0, MR, sym, x, bias, out, out_bf16, -1);
}

#endif

#if defined(TM_VNNI) && defined(TM_HAS_AMX) && defined(__AVX512BF16__)
#define TM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Every tile is 16 rows of 64 bytes: C 16 x 16 float32 (x rows by output rows), A 16 x 32 bf16 (x rows by the 32
// inputs of a block), B 16 pairs of inputs x 16 output rows x 2 bf16 (the pair's two inputs of one output row).
// A call's products go 32 x rows by 32 output rows at a time (two weight tiles): C_ij holds x rows m0 + 16 i .. by
// weight tile t + j, from A_i (those x rows) and B_j (tile t + j's block), so that each tile loaded feeds two
// products (all eight tiles of the register file in use).
// (#defines, not an enum, and the wrappers below: GCC's tile intrinsics paste their tile number into the assembly.)
#define TILE_C00 0
#define TILE_C01 1
#define TILE_C10 2
#define TILE_C11 3
#define TILE_A0 4
#define TILE_A1 5
#define TILE_B0 6
#define TILE_B1 7
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)

static int amx_permitted = -1;  // -1: not asked yet (asking twice is harmless: the answer is the process's)


// Block b of tile t -> bt [16 input pairs][16 output rows][2] bf16, the B tile of that block: each weight
// q * scale + min (int8: scale * code (+ min)) in float32, rounded to bf16 (nearest even) as a bf16 copy of the
// dequantized weight would be.
static inline void widen_block(const tm_x16_weight *w, int64_t t, int64_t b, uint16_t *bt) {
    const int64_t blocks = w->K / 32, per_group = w->G / 32, groups = (w->K + w->G - 1) / w->G;
    const int64_t at = (t * groups + b / per_group) * 16;
    const __m512 d = load16(w->d, at, w->d_f32), m = w->m ? load16(w->m, at, w->m_f32) : _mm512_setzero_ps();
    // word 2n of a pair's register: lane n of its first input, word 2n + 1: lane n of its second
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        __m512i v;  // dword n: the 4 codes of row n for inputs 4s .. 4s + 3, one a byte
        if (w->kind == 0) {
            v = int4_step(w->q + (t * blocks + b) * 8 * 32, s);
        } else {  // code + 128 -> the signed code
            v = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w->q + ((t * blocks + b) * 8 + s) * 64)),
                                 _mm512_set1_epi8((char)0x80));
        }
        __m512 f[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i code = w->kind == 0 ? _mm512_and_si512(_mm512_srli_epi32(v, 8 * c), _mm512_set1_epi32(0xFF))
                                              : _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * c), 24);
            f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), d, m);
        }
        _mm512_store_si512((void *)(bt + 64 * s),
                           _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0])));
        _mm512_store_si512((void *)(bt + 64 * s + 32),
                           _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2])));
    }
}

// Rows m0 .. m0 + 31 (fewer where M ends first) of out, for weight tile t and, where ``pair``, t + 1, from x's
// blocked bf16 codes xb (see pack_rows) and the tiles' widened blocks bt (tile t's, then tile t + 1's); plus bias,
// rounded to bf16 where out_bf16.
static void amx_rows(const tm_x16_weight *w, int64_t t, int pair, int64_t m0, int64_t M, const uint16_t *xb,
                     const uint16_t *bt, const float *bias, void *out, int out_bf16) {
    const int64_t blocks = w->K / 32;
    const int two = M - m0 > 16;
    const uint16_t *a0 = xb + m0 * w->K, *a1 = a0 + 16 * w->K, *b1 = bt + blocks * 512;
    float sums[4][256] __attribute__((aligned(64)));  // C_ij at sums[2 i + j]
    TILE_ZERO(TILE_C00);
    TILE_ZERO(TILE_C01);
    TILE_ZERO(TILE_C10);
    TILE_ZERO(TILE_C11);
    for (int64_t b = 0; b < blocks; b++) {
        TILE_LOAD(TILE_A0, a0 + b * 512, 64);
        TILE_LOAD(TILE_B0, bt + b * 512, 64);
        TILE_DPBF16PS(TILE_C00, TILE_A0, TILE_B0);
        if (pair) {
            TILE_LOAD(TILE_B1, b1 + b * 512, 64);
            TILE_DPBF16PS(TILE_C01, TILE_A0, TILE_B1);
        }
        if (two) {
            TILE_LOAD(TILE_A1, a1 + b * 512, 64);
            TILE_DPBF16PS(TILE_C10, TILE_A1, TILE_B0);
            if (pair) TILE_DPBF16PS(TILE_C11, TILE_A1, TILE_B1);
        }
    }
    TILE_STORE(TILE_C00, sums[0], 64);
    TILE_STORE(TILE_C01, sums[1], 64);
    TILE_STORE(TILE_C10, sums[2], 64);
    TILE_STORE(TILE_C11, sums[3], 64);
    const int64_t rows = M - m0 < 32 ? M - m0 : 32;
    for (int j = 0; j <= pair; j++) {
        const int64_t n0 = 16 * (t + j);
        const __mmask16 live = tile_lanes(w, n0);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(live, bias + n0) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) {
            const __m512 v = _mm512_add_ps(_mm512_load_ps(sums[2 * (r / 16) + j] + 16 * (r % 16)), bv);
            store_lanes(out, out_bf16, w, m0 + r, n0, live, v);
        }
    }
}

// x [M][K] (float32, rounded to nearest even, or bf16 as it is: x_bf16) -> xb in A-tile order: for each 16 rows,
// each block of 32 inputs, the 16 x 32 bf16 of that A tile contiguous (1 KB), so that a tile load reads one run and
// the next block's follows it; rows M .. Mp - 1 zero.
static void pack_rows(const void *x, int x_bf16, int64_t M, int64_t Mp, int64_t K, uint16_t *xb) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < Mp; m++) {
        uint16_t *row = xb + (m / 16) * 16 * K + (m % 16) * 32;  // block b of row m at row + b * 512
        for (int64_t b = 0; b < blocks; b++) {
            __m512i v = _mm512_setzero_si512();
            if (m < M)
                v = x_bf16 ? _mm512_loadu_si512((const void *)((const uint16_t *)x + m * K + 32 * b))
                           : (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps((const float *)x + m * K + 32 * b + 16),
                                                          _mm512_loadu_ps((const float *)x + m * K + 32 * b));
            _mm512_storeu_si512((void *)(row + b * 512), v);
        }
    }
}

// x rows a panel holds: the blocked codes of so many rows fill at most about 1 MiB (a core's L2 share), so that the
// weight tiles of a panel all find its x there; at least 32.
static inline int64_t panel_rows(int64_t K) {
    const int64_t rows = ((int64_t)1 << 20) / (K * 2) / 32 * 32;
    return rows > 32 ? rows : 32;
}

// 0, or -2 when memory runs out. Panels of x rows, outer; within each the threads take pairs of weight tiles, each
// widened once a panel (its bytes asked for a pair ahead) and multiplied with the panel's rows 32 at a time.
static int amx_linear(const tm_x16_weight *w, const void *x, int x_bf16, int64_t M, const float *bias, void *out,
                      int out_bf16) {
    const int64_t K = w->K, blocks = K / 32, Mp = (M + 15) / 16 * 16, tiles = (w->N + 15) / 16;
    const int64_t pairs = (tiles + 1) / 2, panel = panel_rows(K);
    uint16_t *xb = (uint16_t *)aligned_alloc(64, (size_t)((Mp * K * 2 + 63) / 64 * 64));
    if (!xb) return -2;
    pack_rows(x, x_bf16, M, Mp, K, xb);
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *bt = (uint16_t *)tm_thread_scratch(2 * blocks * 1024);  // two tiles' B tiles, block by block
        if (!bt) {
#pragma omp atomic write
            failed = 1;
        }
        tm_configure_tiles(8);
        for (int64_t p0 = 0; p0 < M; p0 += panel) {
            const int64_t p1 = p0 + panel < M ? p0 + panel : M;
#pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < pairs; i++) {
                if (!bt) continue;
                const int64_t t = 2 * i;
                const int pair = t + 1 < tiles;
                for (int j = 0; j <= pair; j++)
                    for (int64_t b = 0; b < blocks; b++) {
                        if (t + 2 + j < tiles) prefetch_block(w, t + 2 + j, b);
                        widen_block(w, t + j, b, bt + (j * blocks + b) * 512);
                    }
                for (int64_t m0 = p0; m0 < p1; m0 += 32) amx_rows(w, t, pair, m0, p1, xb, bt, bias, out, out_bf16);
            }
        }
        _tile_release();
    }
    free(xb);
    return failed ? -2 : 0;
}
#endif

// Whether this build has the AMX kernel and the kernel may use the tiles (Linux hands them out on request, once per
// process).
int tm_amx_available(void) {
#if defined(TM_AMX)
#if defined(TM_AMX_EMULATED)
    amx_permitted = 1;  // a test build's stand-in tiles (simd_common.h)
#else
    if (amx_permitted < 0) amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
    return amx_permitted;
#else
    return 0;
#endif
}

#if defined(TM_VNNI) || defined(TM_X16_AVX2)
#define X16_CHUNK_M 128  // the most rows of x one work item covers (a multiple of TILE_M; chunk_rows)

// Rows m .. end - 1 of tile t (sym: the weight is symmetric, a literal at each call). The first pass over the tile
// asks for the bytes of tile t + PREFETCH_TILES where that is below ``last``: the thread takes tiles t + 1, ... next.
static inline __attribute__((always_inline)) void x16_rows(const tm_x16_weight *w, int64_t t, int64_t last,
                                                           int64_t m, int64_t end, const int sym, const x_codes *x,
                                                           const float *bias, void *out, int out_bf16) {
    int64_t pf = t + PREFETCH_TILES < last ? t + PREFETCH_TILES : -1;
    for (; m + TILE_M <= end; m += TILE_M, pf = -1) x16_tile(w, t, m, TILE_M, sym, x, bias, out, out_bf16, pf);
    if (end - m >= 4) { x16_tile(w, t, m, 4, sym, x, bias, out, out_bf16, pf); m += 4; pf = -1; }
    if (end - m >= 2) { x16_tile(w, t, m, 2, sym, x, bias, out, out_bf16, pf); m += 2; pf = -1; }
    if (end - m >= 1) x16_tile(w, t, m, 1, sym, x, bias, out, out_bf16, pf);
}

// The offset this build's dot products take off a symmetric weight's codes (see the top of this file); 0: none
// (a general weight, or the AVX2 build's int8, whose codes are signed again).
static inline int32_t zero_point(const tm_x16_weight *w) {
    if (!w->symmetric) return 0;
#if defined(TM_VNNI)
    return w->kind == 0 ? 8 : 128;
#else
    return w->kind == 0 ? 8 : 0;
#endif
}

// This thread's share of x's blocks (of ``blocks``) -> their codes; where the weight has a zero point, each block's
// dot product starts at -zero point * the codes' sum. Called by every thread of a parallel region.
static inline void quantize_share(const tm_x16_weight *w, const void *x, int x_bf16, const x_codes *codes,
                                  int64_t blocks) {
    const int32_t offset = zero_point(w);
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t i0 = blocks * id / threads, i1 = blocks * (id + 1) / threads;
    tm_quantize_blocks(x, x_bf16, i0, i1, codes->q, codes->d, codes->s, codes->start);
    if (offset)
        for (int64_t i = i0; i < i1; i++) codes->start[i] *= -offset;
}

#if defined(GROUP_M)
// Rows m .. end - 1 of tiles t .. t + GROUP_T - 1 (all below the weight's tile count), GROUP_M rows at a time.
// Where ``prefetch``, the first pass asks for the bytes of the group after this one, those of its tiles below ``last``.
static inline __attribute__((always_inline)) void group_rows(const tm_x16_weight *w, int64_t t, int64_t last,
                                                             int64_t m, int64_t end, const int sym, const x_codes *x,
                                                             const float *bias, void *out, int out_bf16,
                                                             const int prefetch) {
    int64_t pf = t + GROUP_T, pf_end = t + 2 * GROUP_T < last ? t + 2 * GROUP_T : last;
    for (; m + GROUP_M <= end; m += GROUP_M, pf_end = pf)
        x16_group(w, t, m, GROUP_M, GROUP_T, sym, x, bias, out, out_bf16, prefetch, pf, pf_end);
    if (end - m >= 4) {
        x16_group(w, t, m, 4, GROUP_T, sym, x, bias, out, out_bf16, prefetch, pf, pf_end);
        m += 4, pf_end = pf;
    }
    if (end - m >= 2) {
        x16_group(w, t, m, 2, GROUP_T, sym, x, bias, out, out_bf16, prefetch, pf, pf_end);
        m += 2, pf_end = pf;
    }
    if (end - m >= 1) x16_group(w, t, m, 1, GROUP_T, sym, x, bias, out, out_bf16, prefetch, pf, pf_end);
}
#define ITEM_TILES GROUP_T  // tiles of one work item of a prompt
#else
#define ITEM_TILES 1
#endif

// The rows of a prompt's chunks: M split into ceil(M / X16_CHUNK_M) chunks of equal size (up to a multiple of 8, the
// last one the rest), so that work items cost alike and a static split of them is an even one. (Chunks of
// X16_CHUNK_M rows and a short last one left a thread idle: 288 rows, a prompt of 256 beside 32 decodes, gave one
// thread 1.5 chunks of 128 rows and the other 0.5 of 128 and the 32.)
static inline int64_t chunk_rows(int64_t M) {
    const int64_t chunks = (M + X16_CHUNK_M - 1) / X16_CHUNK_M;
    return ((M + chunks - 1) / chunks + 7) / 8 * 8;
}

// Work item i of a prompt's tiles (M > X16_CHUNK_M), x's codes in ``codes``: (chunk of ``rows`` rows, ITEM_TILES
// tiles), chunk-major, so that split in contiguous ranges each tile reads only its chunk's x codes (at most
// X16_CHUNK_M x K bytes, L2-resident) and the weight is re-read once a chunk (each tile over all the rows ran 1.1-1.6x
// slower at 256-2,048 rows, Zen 4, SmolLM2's shapes). The last item of a tile count that ITEM_TILES does not divide
// takes the tiles left one at a time.
static inline __attribute__((always_inline)) void chunk_item(const tm_x16_weight *w, const x_codes *codes, int64_t M,
                                                             int64_t rows, int64_t i, const float *bias, void *out,
                                                             int out_bf16, const int sym) {
    const int64_t tiles = (w->N + 15) / 16, items = (tiles + ITEM_TILES - 1) / ITEM_TILES;
    const int64_t m0 = i / items * rows, end = m0 + rows < M ? m0 + rows : M;
    const int64_t t = i % items * ITEM_TILES;
#if defined(GROUP_M)
    if (t + GROUP_T <= tiles) {
        // no prefetch: a prompt's chunk finds the weight in the L2
        group_rows(w, t, tiles, m0, end, sym, codes, bias, out, out_bf16, 0);
        return;
    }
#endif
    for (int64_t u = t; u < tiles && u < t + ITEM_TILES; u++)
        x16_rows(w, u, tiles, m0, end, sym, codes, bias, out, out_bf16);
}

// The prompt path and the decode-sized groups, each variant a function of its own (noinline, a literal ``sym`` in
// each) called from inside x16_linear's region: inlined there, their twelve instances made the region's function
// 114 KB, around a decode path that runs a few hundred bytes of it (now 21 KB; 41 KB before the groups). (1-row calls
// were timed at 0.92-1.04x either way: within x16_builds.py's spread at one row, 0.93x for a build against itself.)
#if defined(GROUP_M)
// A decode-sized call's tiles t .. t1 - 1 (this thread's), GROUP_T at a time while whole groups remain; returns the
// first tile left.
static __attribute__((noinline)) int64_t decode_groups_sym(const tm_x16_weight *w, const x_codes *codes, int64_t M,
                                                           int64_t t, int64_t t1, const float *bias, void *out,
                                                           int out_bf16) {
    for (; t + GROUP_T <= t1; t += GROUP_T) group_rows(w, t, t1, 0, M, 1, codes, bias, out, out_bf16, 1);
    return t;
}

static __attribute__((noinline)) int64_t decode_groups(const tm_x16_weight *w, const x_codes *codes, int64_t M,
                                                       int64_t t, int64_t t1, const float *bias, void *out,
                                                       int out_bf16) {
    for (; t + GROUP_T <= t1; t += GROUP_T) group_rows(w, t, t1, 0, M, 0, codes, bias, out, out_bf16, 1);
    return t;
}
#endif

// This thread's share of a prompt's work items (an orphaned ``omp for``: called by every thread of the region).
static __attribute__((noinline)) void prompt_items_sym(const tm_x16_weight *w, const x_codes *codes, int64_t M,
                                                       int64_t rows, int64_t items, const float *bias, void *out,
                                                       int out_bf16) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; i++) chunk_item(w, codes, M, rows, i, bias, out, out_bf16, 1);
}

static __attribute__((noinline)) void prompt_items(const tm_x16_weight *w, const x_codes *codes, int64_t M,
                                                   int64_t rows, int64_t items, const float *bias, void *out,
                                                   int out_bf16) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; i++) chunk_item(w, codes, M, rows, i, bias, out, out_bf16, 0);
}

// x [M][K] (float32, or bf16 where x_bf16) -> out [M][N] (+ bias [N], or NULL), float32 or bf16 (out_bf16), x's
// codes going to ``codes`` (room for M rows: tm_alloc_codes). One parallel region: the threads quantize x's blocks,
// then (after the barrier: a tile reads every row's codes) compute the tiles, which write out themselves (no pass over
// out afterwards: such passes, on one thread and in a fresh buffer each call, left the other cores waiting). x
// quantized in a region of its own, and on one thread below 64 Ki inputs, calls of 1-32 rows ran 1.01-1.11x slower.
// Inside the region ``sym`` is passed as a literal at each call: GCC outlines a region before it inlines, so a
// variable would be tested inside the tiles' loops.
static void x16_linear(const tm_x16_weight *w, const void *x, int x_bf16, const x_codes *codes, int64_t M,
                       const float *bias, void *out, int out_bf16) {
    const int64_t tiles = (w->N + 15) / 16, rows = chunk_rows(M), chunks = (M + rows - 1) / rows;
    const int64_t blocks = M * (w->K / 32);
    const int sym = w->symmetric != 0;
    const int64_t items = chunks * ((tiles + ITEM_TILES - 1) / ITEM_TILES);  // a prompt's work items (chunk_item)
#pragma omp parallel
    {
        // A decode-sized call (one chunk): thread i takes tiles [t0, t1), asking for the first one's bytes before it
        // quantizes its share of x, for the rest a tile (x16_rows) or a group (group_rows) ahead.
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t t0 = tiles * id / threads, t1 = tiles * (id + 1) / threads;
        if (chunks == 1 && t0 < t1)
            for (int64_t b = 0; b < w->K / 32; b++) prefetch_block(w, t0, b);
        quantize_share(w, x, x_bf16, codes, blocks);
#pragma omp barrier
        if (chunks == 1) {
            int64_t t = t0;
#if defined(GROUP_M)
            if (w->kind == 0 && M >= GROUP_FROM_ROWS)
                t = sym ? decode_groups_sym(w, codes, M, t, t1, bias, out, out_bf16)
                        : decode_groups(w, codes, M, t, t1, bias, out, out_bf16);
#endif
            for (; t < t1; t++) {
                if (sym)
                    x16_rows(w, t, t1, 0, M, 1, codes, bias, out, out_bf16);
                else
                    x16_rows(w, t, t1, 0, M, 0, codes, bias, out, out_bf16);
            }
        } else if (sym) {
            prompt_items_sym(w, codes, M, rows, items, bias, out, out_bf16);
        } else {
            prompt_items(w, codes, M, rows, items, bias, out, out_bf16);
        }
    }
}

#endif

// Output rows a register holds: 16 (AVX-512 VNNI), 8 (AVX2), 0 where this build has neither.
int tm_x16_register_rows(void) {
#if defined(TM_VNNI)
    return 16;
#elif defined(TM_X16_AVX2)
    return 8;
#else
    return 0;
#endif
}


// x [M][K] -> out [M][N] (+ bias [N] float32, or NULL); x and out float32, or both bf16 (bf16_io: the model's own
// dtype, read and rounded here, so that a bf16 model's call makes no conversions of its own). Returns 0, -1
// where this build has neither AVX-512 VNNI nor AVX2, -2 when memory runs out.
int tm_quant_linear_x16(const tm_x16_weight *w, const void *x, int64_t M, const float *bias, void *out, int bf16_io) {
#if defined(TM_AMX)
    if (w->amx_from_rows > 0 && M >= w->amx_from_rows && tm_amx_available())
        return amx_linear(w, x, bf16_io, M, bias, out, bf16_io);
#endif
#if defined(TM_VNNI) || defined(TM_X16_AVX2)
    x_codes codes;
    codes.start = NULL;  // (where there is a zero point to take off)
    if (tm_alloc_codes(M, w->K, &codes.q, &codes.d, &codes.s, zero_point(w) ? &codes.start : NULL) != 0) return -2;
    x16_linear(w, x, bf16_io, &codes, M, bias, out, bf16_io);
    free(codes.d);
    return 0;
#else
    (void)w; (void)x; (void)M; (void)bias; (void)out; (void)bf16_io;
    return -1;
#endif
}
