// Greedy sampling's argmax over a step's float32 logits, row by row, with torch.argmax's answer: the first position of
// the largest value, or of the first NaN where a row has one (NaN counts as the largest). kernels/argmax.py holds the
// dispatch; torch.argmax is the reference.
//
// Infinities are values here (-inf rows are whole rows of masked logits), so this file opts out of the build's
// finite-math assumption; NaN is found from the bits (exponent all ones, mantissa not zero) and the max is taken only
// over rows without one. Two passes over a row: its max (vectorized), then the first position that equals it.

#include <stdint.h>

#pragma GCC optimize("no-finite-math-only")

static int64_t first_nan(const float *row, int64_t n) {
    const uint32_t *bits = (const uint32_t *)row;
    uint32_t any = 0;
#pragma omp simd reduction(| : any)
    for (int64_t i = 0; i < n; i++) any |= (bits[i] & 0x7FFFFFFFu) > 0x7F800000u;
    if (!any) return -1;
    for (int64_t i = 0; i < n; i++)
        if ((bits[i] & 0x7FFFFFFFu) > 0x7F800000u) return i;
    return -1;
}

static int64_t row_argmax(const float *row, int64_t n) {
    const int64_t nan_at = first_nan(row, n);
    if (nan_at >= 0) return nan_at;
    float top = row[0];
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < n; i++) top = row[i] > top ? row[i] : top;
    for (int64_t i = 0; i < n; i++)
        if (row[i] == top) return i;
    return 0;
}

// x [rows][cols] float32 (cols >= 1) -> out [rows] int64.
void tm_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * cols >= 262144)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * cols, cols);
}
