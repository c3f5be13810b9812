// kernels/cpu/prefill_attention.c's entry points, for the files that call them (decoder.c).
#ifndef TM_PREFILL_ATTENTION_H
#define TM_PREFILL_ATTENTION_H

#include <stdint.h>

// The chunks' cached prefixes, in a bf16 paged cache (kernels/cpu/paged_attention.c's layout: [slots][2 Hkv][D], K
// heads then V heads): chunk c's prefix is the first prefix_lens[c] tokens (0: none) of block-table row table_rows[c]
// (block_tables [rows][table_stride], blocks of block_size tokens). kernels/cpu_attention.py's PrefillPrefix mirrors
// it.
typedef struct {
    const void *cache;
    const int64_t *block_tables;
    int64_t table_stride, block_size;
    const int64_t *table_rows, *prefix_lens;
} tm_prefill_prefix;

// Every chunk c's causal attention over its own tokens (rows starts[c] .. starts[c] + lens[c] - 1 of q, k, v, out and
// lse) and its cached prefix where ``prefix`` (NULL: none) gives it one, on AMX tiles / zmm registers (AVX512-BF16):
// see prefill_attention.c. Returns 0; -1 where this build or host lacks the kernel or the layout is not taken; -2
// when memory runs out.
int tm_prefill_attention_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                             const uint16_t *v, int64_t v_stride, uint16_t *out, float *lse, const int64_t *starts,
                             const int64_t *lens, int chunks, int Hq, int Hkv, int D, float sm_scale,
                             const tm_prefill_prefix *prefix, int threads);
int tm_prefill_attention_avx512(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                                const uint16_t *v, int64_t v_stride, uint16_t *out, float *lse, const int64_t *starts,
                                const int64_t *lens, int chunks, int Hq, int Hkv, int D, float sm_scale,
                                const tm_prefill_prefix *prefix, int threads);

#endif
