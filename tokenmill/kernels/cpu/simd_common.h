// Helpers shared by the C kernels (included by them; kernels/cpu_native.py hashes this file with the sources).
#ifndef TM_SIMD_COMMON_H
#define TM_SIMD_COMMON_H

#include <stdint.h>
#include <string.h>

// bf16 bits -> the float32 of the same value (exact).
static inline float tm_bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// float32 -> bf16 bits, rounded to nearest even (NaN stays a NaN).
static inline uint16_t tm_bf16_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

// e^x for x <= 0 (and moderate x > 0): 2^n e^r with |r| <= ln2 / 2, e^r by its Taylor polynomial to degree 6
// (relative error < 2e-7, far below the bf16 rounding probabilities get next), 2^n applied by vscalefps (0 below
// e^-87).
static inline __m512 tm_exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts: exact n * hi
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606820309417e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(TM_AMX_EMULATE) && !defined(__AMX_TILE__) && defined(__AVX512BF16__)
// A test build's stand-in for the tile instructions the kernels use (TOKENMILL_CPU_KERNEL_FLAGS=-DTM_AMX_EMULATE on a
// host with AVX512-BF16 and no AMX): plain C over per-thread arrays, every tile 16 rows of 64 bytes (the one shape
// tm_configure_tiles sets), so that the AMX builds' blocking and layouts run, and are tested, where no AMX is. Not for
// speed. tdpbf16ps: C[m][n] (float32) += sum over k < 16 of A's pair k of row m times B's row k, pair n.
#define TM_HAS_AMX 1
#define TM_AMX_EMULATED 1
static __thread uint8_t tm_emulated_tiles[8][16][64] __attribute__((aligned(64)));

static inline void tm_emulated_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy(tm_emulated_tiles[t][r], (const char *)p + r * stride, 64);
}

static inline void tm_emulated_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy((char *)p + r * stride, tm_emulated_tiles[t][r], 64);
}

static inline void tm_emulated_dpbf16ps(int c, int a, int b) {
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float sum;
            memcpy(&sum, &tm_emulated_tiles[c][m][4 * n], 4);
            for (int k = 0; k < 16; k++) {
                uint16_t a0, a1, b0, b1;
                memcpy(&a0, &tm_emulated_tiles[a][m][4 * k], 2);
                memcpy(&a1, &tm_emulated_tiles[a][m][4 * k + 2], 2);
                memcpy(&b0, &tm_emulated_tiles[b][k][4 * n], 2);
                memcpy(&b1, &tm_emulated_tiles[b][k][4 * n + 2], 2);
                sum += tm_bf16_value(a0) * tm_bf16_value(b0) + tm_bf16_value(a1) * tm_bf16_value(b1);
            }
            memcpy(&tm_emulated_tiles[c][m][4 * n], &sum, 4);
        }
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_release
#define _tile_loadd(t, p, stride) tm_emulated_load(t, p, stride)
#define _tile_stored(t, p, stride) tm_emulated_store(t, p, stride)
#define _tile_zero(t) memset(tm_emulated_tiles[t], 0, sizeof tm_emulated_tiles[t])
#define _tile_dpbf16ps(c, a, b) tm_emulated_dpbf16ps(c, a, b)
#define _tile_release() ((void)0)

static inline void tm_configure_tiles(int count) { (void)count; }

#elif defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TM_HAS_AMX 1
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tm_tile_config;

// This thread's tiles 0 .. count - 1 as 16 rows of 64 bytes each (the only shape the kernels use).
static inline void tm_configure_tiles(int count) {
    tm_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < count; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif

#endif
