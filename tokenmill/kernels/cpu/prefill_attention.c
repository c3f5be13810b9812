// A prefill chunk's causal attention over its own tokens on AMX tiles (bf16 products summed in float32): the work
// PyTorch's CPU flash SDPA does for kernels/cpu_attention.py's own_tokens_attention, with the GQA heads of a KV head
// sharing its K / V (no repeat), bf16 in and out, and the log-sum-exp the merge with a cached prefix needs.
//
// Layouts (elements, bf16 unless said): a step's rows, of which each chunk holds a run: q row t's [Hq][D] at
// q + t * q_stride, k / v row t's [Hkv][D] at k + t * k_stride (v likewise), out [T][Hq][D] contiguous, lse [T][Hq]
// float32 (natural log of the sum of e^(scaled score), as SDPA returns it). A chunk's query i sees its keys 0 .. i.
// D a multiple of 32, at most 256.
//
// A chunk with a cached prefix (``prefix``, not NULL, gives it P > 0 tokens) has those P tokens' K / V read from the
// paged cache through its block table, before its own: its query i sees the prefix and its own keys 0 .. i, in one
// softmax (no merge of two partial ones), at the transposed form's speed: the decode kernel's rows (made for one query
// a KV head) took several times longer a key over it (BENCHMARKS.md, issue 24, "Chunks over a cached prefix").
//
// How, in transposed form: each KV head's K rows are copied (padded with zeros to a multiple of 32 keys) and its V
// transposed ([D][keys]), so that both products' A tiles are plain strided loads. Per (query head, block of 16
// queries), the block's Q^T is laid out once as B tiles; then over 32-key blocks up to the diagonal: S^T = K Q^T in
// two C tiles (a 512-bit register then holds one key's scores for the 16 queries, so the softmax's maxima and sums
// are lane-wise, with no reduction across lanes), the probabilities rounded to bf16 (the sum taken over the rounded
// values, as the decode kernel does) and interleaved in pairs of keys as P^T's B tile, and O^T += V^T P^T in C tiles
// over the block's float32 accumulator. The running maximum moves only when a block passes it by STALE_MAX, so the
// accumulator is rarely rescaled.
//
// A second build of the same blocks runs where the host has AVX512-BF16 but no AMX (Zen 4; Intel from Cooper Lake):
// each tile product in zmm registers by vdpbf16ps, the B tile's 16 rows held in registers and A's pairs broadcast
// from memory (a row of a C tile, 16 floats, is one register); the layouts and the softmax are the AMX build's.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefill_attention.h"
#include "simd_common.h"

int tm_amx_available(void);  // quant_linear_x16.c: the build has AMX and Linux lets this process use the tiles

// Chunk c's cached tokens before its own (prefill_attention.h).
static inline int64_t prefix_len(const tm_prefill_prefix *prefix, int c) {
    return prefix ? prefix->prefix_lens[c] : 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define TM_PREFILL_VEC 1
#include <immintrin.h>

#define QB 16  // queries a block (the C tiles' 16 columns)
#define KB 32  // keys a block (two C tiles of S^T; the K dimension of the P V product)

// Keys t0 .. t0 + KB - 1 of KV head h's K rows [Lp][D] and V transposed [D][Lp] for a chunk: its P cached tokens
// (slot t's K at cache + slots[t] * 2 Hkv D, its V Hkv D further; P 0: none), then its L own (k / v rows 0 .. L - 1),
// zero from P + L to Lp (a multiple of KB): the A tiles of the two products (16 keys x 32 dims; 16 dims x 32 keys) are
// then plain strided loads. A block of KB keys at a time, so that V^T's writes go out a whole line per dim.
static void pack_keys(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride, int64_t L,
                      const uint16_t *cache, const int64_t *slots, int64_t P, int Hkv, int64_t Lp, int h, int D,
                      int64_t t0, uint16_t *kp, uint16_t *vt) {
    const int64_t slot_stride = 2 * (int64_t)Hkv * D;
    const uint16_t *vr[KB];
    for (int j = 0; j < KB; j++) {
        const int64_t t = t0 + j;
        const uint16_t *kr = t < P ? cache + slots[t] * slot_stride + (int64_t)h * D
                             : t < P + L ? k + (t - P) * k_stride + (int64_t)h * D : NULL;
        if (kr)
            memcpy(kp + t * D, kr, (size_t)D * 2);
        else
            memset(kp + t * D, 0, (size_t)D * 2);
        vr[j] = t < P ? cache + slots[t] * slot_stride + (int64_t)(Hkv + h) * D
                : t < P + L ? v + (t - P) * v_stride + (int64_t)h * D : NULL;
    }
    for (int d = 0; d < D; d++)
        for (int j = 0; j < KB; j++) vt[d * Lp + t0 + j] = vr[j] ? vr[j][d] : 0;
}

// The running maximum a row's probabilities are taken against moves only when a block's maximum passes it by more
// than this (log2 units): until then probabilities reach up to 2^12 (as exact in float32 and bf16 as any), and the
// accumulators are not rescaled block after block.
#define STALE_MAX 12.0f

// 2^x for -127 <= x <= STALE_MAX (any finite x works; -inf does not: clamp it first): 2^n 2^r with |r| <= 1/2,
// 2^r by a degree-4 polynomial (Taylor's; relative error < 5e-5, far below the 2^-8 of the bf16 rounding the
// probabilities get next), 2^n by vscalefps.
static inline __m512 exp2_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.6181291e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022651f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.69314718f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// One query block's running softmax state: m each query's running maximum in log2 units (score * scale * log2 e),
// l its sum of rounded probabilities.
typedef struct {
    __m512 m, l;
} row_state;

// Q^T's B tiles of the queries q0 .. q0 + rows - 1 of head hq (zero past rows): qt [D / 32][16 dim pairs][16
// queries] of bf16 pairs, each register of 16 queries' pair gathered from their rows (q_stride even: the callers
// check it).
static void layout_q(const uint16_t *q, int64_t q_stride, int hq, int D, int64_t q0, int rows, uint32_t *qt) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32((int)(q_stride / 2)));
    const __mmask16 live = rows >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rows) - 1);
    const uint16_t *base = q + q0 * q_stride + (int64_t)hq * D;
    for (int p = 0; p < D / 2; p++)  // pair p: dims 2p, 2p + 1 (chunk p / 16, pair p % 16 within it)
        _mm512_store_si512((void *)(qt + p * 16),
                           _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, base + 2 * p, 4));
}

// The key block at k0 given its raw scores s [KB][16] (S^T): the rows' state moves on and pt (P^T's B tile: row j =
// keys 2j, 2j + 1 of each query, interleaved) gets the block's probabilities 2^(s c - m), rounded to bf16. Returns
// the rows whose maximum moved, with *correction the factor their accumulators must take (the caller's to apply).
static inline __mmask16 softmax_block(const float *s, int64_t k0, int64_t q0, __m512 c, row_state *st,
                                      __m512 *correction, __m512i *pt) {
    const __m512 neg = _mm512_set1_ps(-INFINITY);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    // key k0 + j is seen by queries q0 + r for r >= k0 + j - q0 (k0 <= q0: every query sees key k0); blocks wholly
    // below the diagonal need no mask
    const int diagonal = k0 + KB - 1 > q0;
    __mmask16 seen[KB];
    __m512 top = neg;  // the block's largest raw score per query
    if (diagonal) {
        for (int j = 0; j < KB; j++) {
            const int64_t from = k0 + j - q0;
            seen[j] = from <= 0 ? (__mmask16)0xFFFF : from >= 16 ? 0 : (__mmask16)(0xFFFFu << from);
            top = _mm512_mask_max_ps(top, seen[j], top, _mm512_loadu_ps(s + 16 * j));
        }
    } else {
        for (int j = 0; j < KB; j++) top = _mm512_max_ps(top, _mm512_loadu_ps(s + 16 * j));
    }
    top = _mm512_mul_ps(top, c);
    const __mmask16 moved = _mm512_cmp_ps_mask(top, _mm512_add_ps(st->m, _mm512_set1_ps(STALE_MAX)), _CMP_GT_OQ);
    if (moved) {  // those rows' maximum moves to the block's: their sums (here) and accumulators are rescaled
        const __m512 m_new = _mm512_mask_mov_ps(st->m, moved, top);
        // 1 where not moved; 0 from -inf (the first block)
        *correction = exp2_16(_mm512_max_ps(_mm512_sub_ps(st->m, m_new), _mm512_set1_ps(-127.0f)));
        st->l = _mm512_mul_ps(st->l, *correction);
        st->m = m_new;
    }
    for (int j = 0; j < KB; j += 2) {  // keys j and j + 1 interleaved
        __m512 p0 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * j), c, st->m));
        __m512 p1 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * (j + 1)), c, st->m));
        if (diagonal) {
            p0 = _mm512_maskz_mov_ps(seen[j], p0);
            p1 = _mm512_maskz_mov_ps(seen[j + 1], p1);
        }
        pt[j / 2] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        st->l = _mm512_dpbf16_ps(st->l, (__m512bh)pt[j / 2], ones);  // + both rounded probabilities
    }
    return moved;
}

// acc [D][16] *= correction, each row.
static inline void rescale(float *acc, int D, __m512 correction) {
    for (int d = 0; d < D; d++) _mm512_storeu_ps(acc + d * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + d * 16),
                                                                           correction));
}

// The rows' outputs acc / l, rounded to bf16 (nearest even), and their log-sum-exps (lse may be NULL).
static void finish_block(const float *acc, row_state st, int rows, int64_t q0, int Hq, int hq, int D, uint16_t *out,
                         float *lse) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), st.l);  // every row < rows saw key 0: its sum is positive
    uint16_t done[256][16];  // [d][query]: acc's layout, rounded
    for (int d = 0; d < D; d++)
        _mm256_storeu_si256((__m256i *)done[d], (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d * 16),
                                                                                       inv)));
    for (int r = 0; r < rows; r++) {
        uint16_t *o = out + ((q0 + r) * Hq + hq) * (int64_t)D;
        for (int d = 0; d < D; d++) o[d] = done[d][r];
    }
    if (lse) {
        float row_max[QB], row_sum[QB];
        _mm512_storeu_ps(row_max, _mm512_mul_ps(st.m, _mm512_set1_ps(0.69314718056f)));  // natural-log units
        _mm512_storeu_ps(row_sum, st.l);
        for (int r = 0; r < rows; r++) lse[(q0 + r) * Hq + hq] = row_max[r] + logf(row_sum[r]);
    }
}

typedef uint32_t pair_t __attribute__((may_alias, aligned(2)));  // two bf16 of a row, read as one dword

// S^T's rows of the KEYS keys from k0 into s [KB][16]: each key's scores (16 queries) a register; for each 32 dims, Q^T's
// 16 pairs of rows in registers and each key's pair of dims broadcast (8 independent chains of products).
static inline __attribute__((always_inline)) void scores(const uint16_t *kp, int D, int64_t k0, const uint32_t *qt,
                                                         float *s, const int KEYS) {
    for (int g = 0; g < KEYS; g += 8) {
        __m512 sk[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) sk[i] = _mm512_setzero_ps();
        for (int cc = 0; cc < D / 32; cc++) {
            __m512bh b[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) b[j] = (__m512bh)_mm512_load_si512((const void *)(qt + (cc * 16 + j) * 16));
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) {
                    const pair_t *krow = (const pair_t *)(kp + (k0 + g + i) * D + 32 * cc);
                    sk[i] = _mm512_dpbf16_ps(sk[i], (__m512bh)_mm512_set1_epi32((int)krow[j]), b[j]);
                }
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) _mm512_store_ps(s + 16 * (g + i), sk[i]);
    }
}

// acc [D][16] (O^T) += V^T P^T over the first PAIRS pairs of keys from k0, 8 dims at a time: each dim's row (16
// queries) a register, P^T's pairs in registers, each dim's pair of keys broadcast.
static inline __attribute__((always_inline)) void values(const uint16_t *vt, int64_t Lp, int D, int64_t k0,
                                                         const __m512i *pt, float *acc, const int PAIRS) {
    for (int d0 = 0; d0 < D; d0 += 8) {
        __m512 o[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) o[i] = _mm512_loadu_ps(acc + (d0 + i) * 16);
#pragma GCC unroll 16
        for (int j = 0; j < PAIRS; j++)
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                const pair_t *vrow = (const pair_t *)(vt + (d0 + i) * Lp + k0);
                o[i] = _mm512_dpbf16_ps(o[i], (__m512bh)_mm512_set1_epi32((int)vrow[j]), (__m512bh)pt[j]);
            }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) _mm512_storeu_ps(acc + (d0 + i) * 16, o[i]);
    }
}

// The query block at q0 (its Q^T in qt) over keys 0 .. last, in zmm registers: s [KB][16] float32 scratch, acc [D][16]
// float32 (O^T, unnormalized), st the rows' softmax state.
static void keys_vec(const uint16_t *kp, const uint16_t *vt, int64_t Lp, int D, int64_t q0, int64_t last, __m512 c,
                     const uint32_t *qt, float *s, float *acc, row_state *st) {
    __m512i pt[KB / 2];
    for (int64_t k0 = 0; k0 <= last; k0 += KB) {
        scores(kp, D, k0, qt, s, KB);
        __m512 correction;
        if (softmax_block(s, k0, q0, c, st, &correction, pt)) rescale(acc, D, correction);
        values(vt, Lp, D, k0, pt, acc, KB / 2);
    }
}
#endif

#if defined(TM_PREFILL_VEC) && defined(TM_HAS_AMX)
#define TM_PREFILL_AMX 1

// GCC's tile intrinsics paste their tile number into the assembly: literal numbers only.
// S0 / S1: S^T's two C tiles; A: a K or V^T tile; B: a Q^T tile, then P^T's; 4 .. 7: O^T's C tiles for 4 chunks of 16
// dims. Where D <= 64 those stay in the tile registers over all the key blocks (stored only to be rescaled), else
// they go through the float32 accumulator in memory 4 chunks at a time (loads, then products, then stores).
#define T_S0 0
#define T_S1 1
#define T_A 2
#define T_B 3
#define O_TILES 4

// O^T's C tiles 4 .. 3 + n for the chunks dc0 .. dc0 + n - 1 (n <= 4) from (load) or to (store) the accumulator.
static inline void move_o(float *acc, int dc0, int n, int load) {
#define MOVE(tile, i)                                         \
    if ((i) < n) {                                            \
        if (load)                                             \
            _tile_loadd(tile, acc + (dc0 + (i)) * 256, 64);   \
        else                                                  \
            _tile_stored(tile, acc + (dc0 + (i)) * 256, 64);  \
    }
    MOVE(4, 0) MOVE(5, 1) MOVE(6, 2) MOVE(7, 3)
#undef MOVE
}

// O^T's tiles 4 .. 3 + n += V^T (chunks dc0 ..) P^T (in tile B) over the key block at k0.
static inline void pv_product(const uint16_t *vt, int64_t Lp, int64_t k0, int dc0, int n) {
#define PV(tile, i)                                                              \
    if ((i) < n) {                                                               \
        _tile_loadd(T_A, vt + (int64_t)(dc0 + (i)) * 16 * Lp + k0, Lp * 2);      \
        _tile_dpbf16ps(tile, T_A, T_B);                                          \
    }
    PV(4, 0) PV(5, 1) PV(6, 2) PV(7, 3)
#undef PV
}

// keys_vec on AMX tiles: S^T in two C tiles, O^T in up to four (or through acc where D > 64).
static void keys_amx(const uint16_t *kp, const uint16_t *vt, int64_t Lp, int D, int64_t q0, int64_t last, __m512 c,
                     const uint32_t *qt, float *s, float *acc, row_state *st) {
    const int chunks = D / 32, dchunks = D / 16;
    __m512i pt[KB / 2];
    const int resident = dchunks <= O_TILES;
    if (resident) move_o(acc, 0, dchunks, 1);
    for (int64_t k0 = 0; k0 <= last; k0 += KB) {
        _tile_zero(T_S0);
        _tile_zero(T_S1);
        for (int cc = 0; cc < chunks; cc++) {
            _tile_loadd(T_B, qt + cc * 256, 64);
            _tile_loadd(T_A, kp + k0 * D + 32 * cc, D * 2);
            _tile_dpbf16ps(T_S0, T_A, T_B);
            _tile_loadd(T_A, kp + (k0 + 16) * D + 32 * cc, D * 2);
            _tile_dpbf16ps(T_S1, T_A, T_B);
        }
        _tile_stored(T_S0, s, 64);
        _tile_stored(T_S1, s + 16 * 16, 64);
        __m512 correction;
        if (softmax_block(s, k0, q0, c, st, &correction, pt)) {
            if (resident) move_o(acc, 0, dchunks, 0);
            rescale(acc, D, correction);
            if (resident) move_o(acc, 0, dchunks, 1);
        }
        _tile_loadd(T_B, pt, 64);
        if (resident) {
            pv_product(vt, Lp, k0, 0, dchunks);
        } else {
            for (int dc0 = 0; dc0 < dchunks; dc0 += O_TILES) {
                const int n = dchunks - dc0 < O_TILES ? dchunks - dc0 : O_TILES;
                move_o(acc, dc0, n, 1);
                pv_product(vt, Lp, k0, dc0, n);
                move_o(acc, dc0, n, 0);
            }
        }
    }
    if (resident) move_o(acc, 0, dchunks, 0);
}
#endif

#if defined(TM_PREFILL_VEC)
// Query head hq's block of queries q0 .. q0 + 15 (those < L; after P cached keys: query i is key P + i) over keys
// 0 .. their last, in transposed form, on AMX tiles (amx) or zmm registers: qt: [D / 32][16 dim pairs][16 queries][2]
// scratch, s: [KB][16] float32, acc: [D][16] float32.
static void query_block(const uint16_t *q, int64_t q_stride, uint16_t *out, float *lse, int64_t L, int64_t P, int Hq,
                        int hq, int D, int64_t q0, int64_t Lp, const uint16_t *kp, const uint16_t *vt, float sm_scale,
                        uint32_t *qt, float *s, float *acc, int amx) {
#if !defined(TM_PREFILL_AMX)
    (void)amx;
#endif
    const int rows = L - q0 < QB ? (int)(L - q0) : QB;
    layout_q(q, q_stride, hq, D, q0, rows, qt);
    memset(acc, 0, sizeof(float) * (size_t)(D * QB));
    row_state st = {_mm512_set1_ps(-INFINITY), _mm512_setzero_ps()};
    const __m512 c = _mm512_set1_ps(sm_scale * 1.44269504089f);
#if defined(TM_PREFILL_AMX)
    if (amx)
        keys_amx(kp, vt, Lp, D, P + q0, P + q0 + rows - 1, c, qt, s, acc, &st);
    else
#endif
        keys_vec(kp, vt, Lp, D, P + q0, P + q0 + rows - 1, c, qt, s, acc, &st);
    finish_block(acc, st, rows, q0, Hq, hq, D, out, lse);
}

// The (chunk, query block) pairs in the order the threads take them: the most keys first (block b of a chunk sees its
// prefix and up to (b + 1) QB own keys), so that the last ones taken are short.
typedef struct {
    int64_t keys, chunk, block;
} block_work;

static int heavier_first(const void *a, const void *b) {
    const int64_t ka = ((const block_work *)a)->keys, kb = ((const block_work *)b)->keys;
    return ka < kb ? 1 : ka > kb ? -1 : 0;
}

// Every chunk c's attention over its own tokens (rows starts[c] .. starts[c] + lens[c] - 1 of q, k, v, out and lse,
// each chunk on its own: the prefill chunks of one step) and its cached prefix where ``prefix`` gives it one, on AMX
// tiles (amx) or zmm registers. Returns 0; -2 when memory runs out. The arguments are checked by the callers.
static int prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                             const uint16_t *v, int64_t v_stride, uint16_t *out, float *lse, const int64_t *starts,
                             const int64_t *lens, int chunks, int Hq, int Hkv, int D, float sm_scale,
                             const tm_prefill_prefix *prefix, int threads, int amx) {
    // chunk c's packed K / V from offsets[c]; its prefix's cache slots from slot_at[c] (prefix_len(c) of them); its
    // key blocks (of KB keys) from key_at[c]
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)(3 * chunks + 3));
    if (!offsets) return -2;
    int64_t *slot_at = offsets + chunks + 1, *key_at = slot_at + chunks + 1;
    int64_t pairs = 0;  // (chunk, query block) pairs
    offsets[0] = slot_at[0] = key_at[0] = 0;
    for (int c = 0; c < chunks; c++) {
        const int64_t P = prefix_len(prefix, c), blocks = (P + lens[c] + KB - 1) / KB;
        offsets[c + 1] = offsets[c] + 2 * Hkv * blocks * KB * D;
        slot_at[c + 1] = slot_at[c] + P;
        key_at[c + 1] = key_at[c] + blocks;
        pairs += (lens[c] + QB - 1) / QB;
    }
    uint16_t *packed = aligned_alloc(64, sizeof(uint16_t) * (size_t)((offsets[chunks] + 31) / 32 * 32));
    block_work *order = malloc(sizeof(block_work) * (size_t)pairs);
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(slot_at[chunks] + 1));
    if (!packed || !order || !slots) {
        free(offsets);
        free(packed);
        free(order);
        free(slots);
        return -2;
    }
    int64_t n = 0;
    for (int c = 0; c < chunks; c++) {
        const int64_t P = prefix_len(prefix, c);
        for (int64_t b = 0; b < (lens[c] + QB - 1) / QB; b++) order[n++] = (block_work){P + (b + 1) * QB, c, b};
        if (P) {  // the prefix's cache slots, through its block table
            const int64_t *blocks = prefix->block_tables + prefix->table_rows[c] * prefix->table_stride;
            for (int64_t t = 0; t < P; t++)
                slots[slot_at[c] + t] = blocks[t / prefix->block_size] * prefix->block_size + t % prefix->block_size;
        }
    }
    qsort(order, (size_t)pairs, sizeof(block_work), heavier_first);
    const int G = Hq / Hkv;
    const int64_t items = pairs * Hq;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        // the packing: (chunk, head, block of KB keys) items, chunk c's from key_at[c] * Hkv
#pragma omp for schedule(static)
        for (int64_t i = 0; i < key_at[chunks] * Hkv; i++) {
            int c = 0;
            while (key_at[c + 1] * Hkv <= i) c++;
            const int64_t local = i - key_at[c] * Hkv, blocks = key_at[c + 1] - key_at[c];
            const int h = (int)(local / blocks);
            const int64_t P = prefix_len(prefix, c), Lp = blocks * KB;
            uint16_t *kp = packed + offsets[c] + 2 * h * Lp * D;
            pack_keys(k + starts[c] * k_stride, k_stride, v + starts[c] * v_stride, v_stride, lens[c],
                      P ? (const uint16_t *)prefix->cache : NULL, slots + slot_at[c], P, Hkv, Lp, h, D,
                      local % blocks * KB, kp, kp + Lp * D);
        }
        uint32_t *qt = aligned_alloc(64, (size_t)(QB * D * 2));
        float *s = aligned_alloc(64, sizeof(float) * KB * 16);
        float *acc = aligned_alloc(64, sizeof(float) * (size_t)(QB * D));
        if (!qt || !s || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#if defined(TM_PREFILL_AMX)
        if (amx) tm_configure_tiles(8);
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!qt || !s || !acc) continue;
            const block_work *work = order + i / Hq;
            const int64_t c = work->chunk, start = starts[c], P = prefix_len(prefix, (int)c);
            const int hq = (int)(i % Hq), h = hq / G;
            const int64_t Lp = (P + lens[c] + KB - 1) / KB * KB;
            const uint16_t *kp = packed + offsets[c] + 2 * h * Lp * D;
            query_block(q + start * q_stride, q_stride, out + start * Hq * D, lse ? lse + start * Hq : NULL, lens[c],
                        P, Hq, hq, D, work->block * QB, Lp, kp, kp + Lp * D, sm_scale, qt, s, acc, amx);
        }
#if defined(TM_PREFILL_AMX)
        if (amx) _tile_release();
#endif
        free(qt);
        free(s);
        free(acc);
    }
    free(packed);
    free(order);
    free(slots);
    free(offsets);
    return failed ? -2 : 0;
}

// The layouts both builds take: 0 if so, -1 if not (q's rows gathered as pairs: an even q_stride).
static int prefill_arguments(int64_t q_stride, const int64_t *lens, int chunks, int Hq, int Hkv, int D,
                             const tm_prefill_prefix *prefix) {
    if (D % 32 != 0 || D > 256 || Hkv <= 0 || Hq % Hkv != 0 || chunks <= 0 || q_stride % 2 != 0) return -1;
    if (prefix && (!prefix->cache || !prefix->block_tables || !prefix->table_rows || !prefix->prefix_lens
                   || prefix->block_size <= 0))
        return -1;
    for (int c = 0; c < chunks; c++)
        if (lens[c] <= 0 || prefix_len(prefix, c) < 0) return -1;
    return 0;
}
#endif

// Every chunk c's attention over its own tokens and its cached prefix (``prefix``: NULL, none) on AMX tiles
// (prefill_attention). Returns 0; -1 where this build or host has
// no AMX or the layout is not taken (prefill_arguments); -2 when memory runs out.
int tm_prefill_attention_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                             const uint16_t *v, int64_t v_stride, uint16_t *out, float *lse, const int64_t *starts,
                             const int64_t *lens, int chunks, int Hq, int Hkv, int D, float sm_scale,
                             const tm_prefill_prefix *prefix, int threads) {
#if defined(TM_PREFILL_AMX)
    if (!tm_amx_available() || prefill_arguments(q_stride, lens, chunks, Hq, Hkv, D, prefix) != 0) return -1;
    return prefill_attention(q, q_stride, k, k_stride, v, v_stride, out, lse, starts, lens, chunks, Hq, Hkv, D,
                             sm_scale, prefix, threads, 1);
#else
    (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)out; (void)lse; (void)starts;
    (void)lens; (void)chunks; (void)Hq; (void)Hkv; (void)D; (void)sm_scale; (void)prefix; (void)threads;
    return -1;
#endif
}

// The same on zmm registers (AVX512-BF16): -1 where this build has no AVX512-BF16 or the layout is not taken.
int tm_prefill_attention_avx512(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                                const uint16_t *v, int64_t v_stride, uint16_t *out, float *lse, const int64_t *starts,
                                const int64_t *lens, int chunks, int Hq, int Hkv, int D, float sm_scale,
                                const tm_prefill_prefix *prefix, int threads) {
#if defined(TM_PREFILL_VEC)
    if (prefill_arguments(q_stride, lens, chunks, Hq, Hkv, D, prefix) != 0) return -1;
    return prefill_attention(q, q_stride, k, k_stride, v, v_stride, out, lse, starts, lens, chunks, Hq, Hkv, D,
                             sm_scale, prefix, threads, 0);
#else
    (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)out; (void)lse; (void)starts;
    (void)lens; (void)chunks; (void)Hq; (void)Hkv; (void)D; (void)sm_scale; (void)prefix; (void)threads;
    return -1;
#endif
}
