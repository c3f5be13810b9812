// A whole pre-norm GQA decoder stack (Llama, Qwen2, Mistral, SmolLM: RMSNorm, rotary q/k, GQA attention over the
// paged cache, SwiGLU) for one engine step, in one call from Python.
//
// Why: run from a compiled graph, every layer costs four custom-op dispatches and ~seven ctypes calls, Python that
// runs on the main thread while the OpenMP worker threads spin at the next parallel region's edge. At 32 decodes of
// SmolLM2 on two cores that was ~20% of the main thread's time (benchmarks/results, issue 24). Here the same kernels
// run back to back from C: the int4 / int8 GEMMs (quant_linear_x16.c), the rotation (rotary.c), the cache write
// and the paged attention (paged_attention.c), the gated activation (gated_activation.c), with the norms and the
// residual adds below. models/cpu_stack.py decides when a model and a step qualify and is the reference's caller.
//
// Arithmetic, as models/llama.py's DecoderLayer computes it eagerly in the model's dtype. A bf16 model: every tensor
// between kernels is bf16; a residual add is rounded to bf16 (x = x + y); RMSNorm widens x to float32, scales it by
// 1 / sqrt(mean(x^2) + eps), rounds that to bf16, then multiplies by the bf16 weight and rounds again (``weight *
// x.to(bf16)``). A float32 model (the settled dtype on hosts without AVX512-BF16 or AMX): every tensor between kernels,
// the norms' weights and the residual stream are float32; new K / V are rounded to the cache's bf16 as they are
// written (a float32 cache takes them as they are); prefill chunks are not taken (the own-token kernels are bf16).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "prefill_attention.h"
#include "simd_common.h"

// The kernels this file calls (their own files document them); the weight handles are quant_linear_x16.c's
// tm_x16_weight, opaque here.
int tm_quant_linear_x16(const void *w, const void *x, int64_t M, const float *bias, void *out, int bf16_io);
int tm_rope_qk(const void *q, int64_t q_tok, int64_t q_head, int64_t Hq, const void *k, int64_t k_tok,
               int64_t k_head, int64_t Hk, void *q_out, void *k_out, int64_t q_out_tok, int64_t k_out_tok, int64_t T,
               int64_t D, int64_t rot, const int64_t *positions, int64_t num_positions, const float *cos,
               const float *sin, int bf16, int threads);
int tm_write_kv(void *cache, int64_t num_slots, const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                const int64_t *slots, int64_t T, int64_t hkv, int64_t dim, int64_t elem_bytes);
int tm_paged_attention_bf16(const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t rows, const void *cache,
                            const float *scales, int kind, const int64_t *block_tables, int64_t table_stride,
                            const int32_t *req, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_first,
                            const int32_t *kv_len, const int32_t *causal, int num_segments, int Hq, int Hkv, int D,
                            int block_size, float sm_scale, float softcap, int threads);
int tm_paged_attention_f32(const float *q, int64_t q_stride, float *out, int64_t rows, const void *cache,
                           const float *scales, int kind, const int64_t *block_tables, int64_t table_stride,
                           const int32_t *req, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_first,
                           const int32_t *kv_len, const int32_t *causal, int num_segments, int Hq, int Hkv, int D,
                           int block_size, float sm_scale, float softcap, int threads);
void tm_silu_mul(const void *gu, int64_t gu_stride, void *out, int64_t rows, int64_t inter, int bf16, int threads);
typedef int (*own_tokens_fn)(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                             const uint16_t *v, int64_t v_stride, uint16_t *out, float *lse, const int64_t *starts,
                             const int64_t *lens, int chunks, int Hq, int Hkv, int D, float sm_scale,
                             const tm_prefill_prefix *prefix, int threads);

// One layer's constant arguments (models/cpu_stack.py's DecoderLayerArgs mirrors it). Biases are float32 or NULL.
typedef struct {
    const void *qkv, *o, *gate_up, *down;  // tm_x16_weight handles; qkv's rows [q | k | v], gate_up's [gate | up]
    const float *qkv_bias, *o_bias;
    const void *input_norm, *post_norm;  // [hidden] in the model's dtype
    void *cache;  // [num_slots][2 Hkv][D] (step's cache_f32: float32, else bf16): this layer's paged cache (K heads,
                  // then V heads, per slot)
} tm_decoder_layer;

// The model's shape and the step's attention arguments (models/cpu_stack.py's DecoderStepArgs).
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, rot;
    float eps, sm_scale;
    const float *cos, *sin;  // [num_positions][rot / 2] float32
    int64_t num_positions;
    int64_t num_slots, block_size;  // of every layer's cache
    const void *final_norm;  // [hidden] in the model's dtype
    int64_t f32, cache_f32;  // 1: float32 activations (else bf16); 1: a float32 cache (else bf16; f32 only)
    // the step's segments (kernels/cpu_attention.py _segments): block tables and the six rows
    const int64_t *block_tables;
    int64_t table_stride;
    const int32_t *req, *q_start, *q_len, *kv_first, *kv_len, *causal;
    int64_t num_segments;
    // Prefill chunks, which no segment covers: their attention by prefill_attention.c's kernel (own_kernel 1: AMX,
    // 2: AVX512-BF16; 0: none, the segments cover every row), chunk c's rows chunk_starts[c] .. + chunk_lens[c], over
    // its cached prefix too where chunk_prefixes (NULL: no chunk has one) gives it one: [2][num_chunks], the
    // chunks' block-table rows, then their prefix lengths (0: none). lse: [T][heads] float32 scratch for the kernel.
    int64_t own_kernel;
    const int64_t *chunk_starts, *chunk_lens, *chunk_prefixes;
    int64_t num_chunks;
    float *lse;
} tm_decoder_step;

#define MIN_PARALLEL_ROWS 64  // fewer rows than this: the norms and adds run on the calling thread

// out[t] = bf16(w * bf16(x[t] / rms(x[t]))) for T rows of n; with ``add`` (not NULL), x[t] = bf16(x[t] + add[t])
// first (the residual stream updated in place), as two bf16 ops would round it.
static void add_rms_norm(uint16_t *x, const uint16_t *add, const uint16_t *w, uint16_t *out, int64_t T, int64_t n,
                         float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T >= MIN_PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        uint16_t *xr = x + t * n;
        if (add) {
            const uint16_t *ar = add + t * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) xr[i] = tm_bf16_bits(tm_bf16_value(xr[i]) + tm_bf16_value(ar[i]));
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++) {
            const float v = tm_bf16_value(xr[i]);
            squares += v * v;
        }
        const float inv = 1.0f / sqrtf(squares / (float)n + eps);
        uint16_t *o = out + t * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            o[i] = tm_bf16_bits(tm_bf16_value(w[i]) * tm_bf16_value(tm_bf16_bits(tm_bf16_value(xr[i]) * inv)));
    }
}

// add_rms_norm for a float32 model: out[t] = w * (x[t] / rms(x[t])), x[t] += add[t] first where ``add`` is given.
static void add_rms_norm_f32(float *x, const float *add, const float *w, float *out, int64_t T, int64_t n, float eps,
                             int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T >= MIN_PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float *xr = x + t * n;
        if (add) {
            const float *ar = add + t * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) xr[i] += ar[i];
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++) squares += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(squares / (float)n + eps);
        float *o = out + t * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

static void norm(const tm_decoder_step *s, void *x, const void *add, const void *w, void *out, int64_t T,
                 int threads) {
    if (s->f32)
        add_rms_norm_f32(x, add, w, out, T, s->hidden, s->eps, threads);
    else
        add_rms_norm(x, add, w, out, T, s->hidden, s->eps, threads);
}

// A float32 model's new K / V into a bf16 cache, rounded to nearest even as ``tensor.to(torch.bfloat16)`` rounds
// (tm_write_kv's contract otherwise: slots past the cache -> -1, nothing written; negative slots skipped).
static int write_kv_f32_bf16(void *cache, int64_t num_slots, const float *k, const float *v, int64_t stride,
                             const int64_t *slots, int64_t T, int64_t hkv, int64_t dim) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -1;
    const int64_t n = hkv * dim;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        uint16_t *slot = (uint16_t *)cache + slots[t] * 2 * n;
        for (int64_t i = 0; i < n; i++) slot[i] = tm_bf16_bits(k[t * stride + i]);
        for (int64_t i = 0; i < n; i++) slot[n + i] = tm_bf16_bits(v[t * stride + i]);
    }
    return 0;
}

// The stack over T rows: x [T][hidden] in the model's dtype (the embeddings; the residual stream, overwritten) ->
// out [T][hidden] (the final norm's output). positions, slots [T] int64 (slot < 0: a padding row, nothing written).
// scratch: T * (2 hidden + (heads + 2 kv_heads) D + heads D + 3 intermediate) elements of the model's dtype. Returns 0,
// or the first failure: -1 a GEMM, -2 a position outside the rotary table, -3 a slot outside the cache, -4
// attention's scratch memory, -5 the own-token kernel refused the chunks (the caller checks what it takes first).
int tm_decoder_stack(const tm_decoder_step *s, const tm_decoder_layer *layers, int64_t num_layers, void *x, int64_t T,
                     const int64_t *positions, const int64_t *slots, void *scratch, void *out, int threads) {
    const int64_t H = s->hidden, D = s->head_dim, q_size = s->heads * D, kv_size = s->kv_heads * D;
    const int64_t width = q_size + 2 * kv_size, inter = s->intermediate;
    const int f32 = s->f32 != 0, bf16 = !f32;
    const size_t elem = f32 ? sizeof(float) : sizeof(uint16_t);
#define AT(base, offset) ((void *)((char *)(base) + (size_t)(offset) * elem))  // element ``offset`` of a buffer
    void *h = scratch;                    // [T][hidden]: a norm's output
    void *qkv = AT(h, T * H);             // [T][width]
    void *attn = AT(qkv, T * width);      // [T][q_size]
    void *proj = AT(attn, T * q_size);    // [T][hidden]: o's or down's output, added to x
    void *gate_up = AT(proj, T * H);      // [T][2 inter]
    void *act = AT(gate_up, T * 2 * inter);  // [T][inter]
    const void *pending = NULL;  // the last projection not yet added to x
    const own_tokens_fn own = bf16 && s->own_kernel == 1 ? tm_prefill_attention_amx
                              : bf16 && s->own_kernel == 2 ? tm_prefill_attention_avx512 : NULL;
    const int cache_kind = f32 && s->cache_f32 ? 0 : 1;  // paged_attention.c's KIND_F32 / KIND_BF16
    for (int64_t i = 0; i < num_layers; i++) {
        const tm_decoder_layer *l = layers + i;
        norm(s, x, pending, l->input_norm, h, T, threads);
        if (tm_quant_linear_x16(l->qkv, h, T, l->qkv_bias, qkv, bf16)) return -1;
        void *k = AT(qkv, q_size), *v = AT(k, kv_size);
        if (tm_rope_qk(qkv, width, D, s->heads, k, width, D, s->kv_heads, qkv, k, width, width, T, D, s->rot,
                       positions, s->num_positions, s->cos, s->sin, bf16, threads))
            return -2;
        const int written = f32 && !s->cache_f32
                                ? write_kv_f32_bf16(l->cache, s->num_slots, k, v, width, slots, T, s->kv_heads, D)
                                : tm_write_kv(l->cache, s->num_slots, k, width, v, width, slots, T, s->kv_heads, D,
                                              (int64_t)elem);
        if (written) return -3;
        // the segments' rows (the others zero), then the chunks' rows over them
        if (s->num_segments) {
            const int code =
                f32 ? tm_paged_attention_f32(qkv, width, attn, T, l->cache, NULL, cache_kind, s->block_tables,
                                             s->table_stride, s->req, s->q_start, s->q_len, s->kv_first, s->kv_len,
                                             s->causal, (int)s->num_segments, (int)s->heads, (int)s->kv_heads, (int)D,
                                             (int)s->block_size, s->sm_scale, 0.0f, threads)
                    : tm_paged_attention_bf16(qkv, width, attn, T, l->cache, NULL, cache_kind, s->block_tables,
                                              s->table_stride, s->req, s->q_start, s->q_len, s->kv_first, s->kv_len,
                                              s->causal, (int)s->num_segments, (int)s->heads, (int)s->kv_heads,
                                              (int)D, (int)s->block_size, s->sm_scale, 0.0f, threads);
            if (code) return -4;
        }
        if (own && s->num_chunks) {
            const tm_prefill_prefix prefix = {l->cache, s->block_tables, s->table_stride, s->block_size,
                                              s->chunk_prefixes, s->chunk_prefixes + s->num_chunks};
            const int code = own(qkv, width, k, width, v, width, attn, s->lse, s->chunk_starts, s->chunk_lens,
                                 (int)s->num_chunks, (int)s->heads, (int)s->kv_heads, (int)D, s->sm_scale,
                                 s->chunk_prefixes ? &prefix : NULL, threads);
            if (code) return code == -2 ? -4 : -5;
        }
        if (tm_quant_linear_x16(l->o, attn, T, l->o_bias, proj, bf16)) return -1;
        norm(s, x, proj, l->post_norm, h, T, threads);
        if (tm_quant_linear_x16(l->gate_up, h, T, NULL, gate_up, bf16)) return -1;
        tm_silu_mul(gate_up, 2 * inter, act, T, inter, bf16, threads);
        if (tm_quant_linear_x16(l->down, act, T, NULL, proj, bf16)) return -1;
        pending = proj;
    }
    norm(s, x, pending, s->final_norm, out, T, threads);
    return 0;
#undef AT
}
