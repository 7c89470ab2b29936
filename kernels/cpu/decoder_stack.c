/* Every decoder layer of a step in one C call: the same kernels the layers call one by one from
 * Python (bf16 matmuls on weights in pairs or float32 ones on GGUF blocks, RMSNorm, rotary, the
 * KV cache write, decode and prefill attention, SiLU x up), in the same order on the same buffers, so the result is the
 * same to the bit.
 *
 * Why: between those ~10 calls a layer (~310 a step of a 30-layer model) the Python around
 * them - module calls, argument checks, allocations, the attention plan's lookup - took a
 * sizeable part of a step at 32 sequences (2-core Zen 4; benchmarks/RESULTS.md, "Figures behind
 * design choices in the code"), and the OpenMP worker thread waits through all of it. Here the
 * kernels are reached through function pointers into their own libraries
 * (kernels/cpu/decoder_stack.py passes them), so each stays built and tested on its own.
 *
 * Built at first use by kernels/cpu/native_build.py.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_dtypes.h"

typedef void (*MatmulFn)(const void* x, const void* w, const float* bias, void* y, int rows, int64_t in,
                         int64_t groups, int num_threads);
typedef void (*NormFn)(const void* x, const void* weight, void* out, int rows, int hidden, float eps, int dtype,
                       int num_threads);
typedef void (*AddNormFn)(const void* h, const void* delta, void* h_out, const void* weight, void* out, int rows,
                          int hidden, float eps, int dtype, int num_threads);
typedef void (*RotaryFn)(const void* x, int64_t row_stride, void* out, const void* cos, const void* sin, int tokens,
                         int heads, int head_dim, int dtype, int num_threads);
typedef int64_t (*CacheWriteFn)(const void* key, int64_t key_stride, const void* value, int64_t value_stride,
                                void* key_cache, void* value_cache, const int64_t* slots, int64_t tokens,
                                int64_t row_bytes, int64_t num_slots);
typedef int (*DecodeFn)(const void* query, int64_t q_stride, const void* key_cache, const void* value_cache,
                        void* out, const int32_t* tables, int64_t table_width, const int32_t* lens,
                        const int64_t* rows, int num_decodes, int heads, int kv_heads, int dim, int block_size,
                        float scale, int dtype, int num_threads);
typedef int (*PrefillFn)(const void* query, int64_t q_stride, const void* key_cache, const void* value_cache,
                         void* out, const int64_t* all_slots, const int64_t* slot_starts, const int32_t* q_starts,
                         const int32_t* q_lens, const int32_t* seq_lens, int num_chunks, int heads, int kv_heads,
                         int dim, float scale, int num_threads, int dtype);
typedef void (*SiluMulFn)(const void* x, void* out, int64_t rows, int64_t n, int num_threads, int dtype);
typedef void (*BlockMatmulFn)(const float* x, const uint8_t* q, const float* d, const float* m, const float* bias,
                              float* y, int rows, int64_t in, int64_t groups, int kind, int batch_invariant,
                              int num_threads);

/* The kernels, as addresses of their libraries' functions. */
typedef struct {
    MatmulFn matmul;
    NormFn norm;
    AddNormFn add_norm;
    RotaryFn rotary;
    CacheWriteFn write_cache;
    DecodeFn decode;
    PrefillFn prefill;
    SiluMulFn silu_mul;
    BlockMatmulFn block_matmul;
} Kernels;

/* A linear layer. bf16: its weight in pairs (kernels/cpu/bf16_matmul.c) and, where it has them,
 * the checkpoint's GGUF blocks that steps of a few rows multiply in float32; float32: the blocks
 * only, pairs NULL (kernels/cpu/block_matmul.c; backend/cpu/linear_methods.py's Blocks). */
typedef struct {
    const void* pairs;
    const float* bias; /* float32 [groups * 16] or NULL */
    int64_t groups;
    const uint8_t* codes; /* NULL: no blocks */
    const float* scales;
    const float* offsets;
    int kind;
    int batch_invariant; /* kernels/cpu/block_matmul.c's */
} Linear;

/* One layer's norms, linears and KV cache. */
typedef struct {
    const void* input_norm;
    const void* post_norm;
    Linear qkv, o, gate_up, down;
    void* key_cache;
    void* value_cache;
} Layer;

/* One step: shapes, the attention plan, and the buffers (rows of `tokens`, in the step's dtype). */
typedef struct {
    int tokens, hidden, heads, kv_heads, head_dim, intermediate, block_size, dtype, num_threads;
    int64_t num_slots;
    float eps, scale;
    const void* cos; /* [tokens, head_dim] */
    const void* sin;
    const int64_t* slot_mapping;
    int num_decodes; /* decode attention: kernels/cpu/paged_decode.c's arguments */
    const int32_t* tables;
    int64_t table_width;
    const int32_t* lens;
    const int64_t* decode_rows;
    int num_chunks; /* prefill attention: kernels/cpu/paged_prefill.c's */
    const int64_t* chunk_slots;
    const int64_t* slot_starts;
    const int32_t* q_starts;
    const int32_t* q_lens;
    const int32_t* seq_lens;
    const void* final_norm;
    int few_rows; /* the linears with blocks multiply those (float32 rows in xf, out in yf) */
    int num_outputs;           /* rows whose hidden states the caller wants (those it samples) */
    const int64_t* output_rows; /* NULL: every row; else num_outputs rows, ascending, distinct */
    int few_output_rows;       /* few_rows for num_outputs rows */
    float* xf;
    float* yf;
    void* h;       /* [tokens, hidden]: the embeddings in, the residual stream (in place) */
    void* x;       /* [tokens, hidden]: normed rows */
    void* qkv;     /* [tokens, qkv_groups * 16] */
    void* qk;      /* [tokens, heads + kv_heads, head_dim]: q and k rotated */
    void* attn;    /* [tokens, heads, head_dim] */
    void* delta;   /* [tokens, hidden]: o_proj's, then down_proj's output */
    void* gate_up; /* [tokens, 2 * intermediate] */
    void* act;     /* [tokens, intermediate] */
    void* out;     /* [tokens, hidden]: the final norm's output (its first num_outputs rows where output_rows) */
} Step;

/* y = x @ W^T (+ bias), as Linear.forward computes it for these rows: float32 rows through the
 * GGUF blocks (a float32 layer keeps no other weight), bf16 rows through the pairs, or for a
 * few rows through the blocks in float32. */
static void linear(const Kernels* k, const Linear* w, const void* x, void* y, int rows, int64_t in, int few_rows,
                   const Step* s) {
    if (!w->pairs) {
        k->block_matmul(x, w->codes, w->scales, w->offsets, w->bias, y, rows, in, w->groups, w->kind, w->batch_invariant,
                        s->num_threads);
        return;
    }
    if (!(few_rows && w->codes)) {
        k->matmul(x, w->pairs, w->bias, y, rows, in, w->groups, s->num_threads);
        return;
    }
    const int64_t n_in = rows * in, n_out = rows * w->groups * 16;
    for (int64_t i = 0; i < n_in; ++i) s->xf[i] = bf16_to_f32(((const uint16_t*)x)[i]);
    k->block_matmul(s->xf, w->codes, w->scales, w->offsets, w->bias, s->yf, rows, in, w->groups, w->kind,
                    w->batch_invariant, s->num_threads);
    for (int64_t i = 0; i < n_out; ++i) ((uint16_t*)y)[i] = f32_to_bf16(s->yf[i]);
}

/* rows[i] of a [*, width bytes] buffer moved to row i: rows ascending and distinct, so no row is
 * overwritten before it moves. */
static void keep_rows(void* buffer, const int64_t* rows, int count, int64_t width) {
    char* base = (char*)buffer;
    for (int i = 0; i < count; ++i)
        if (rows[i] != i) memmove(base + i * width, base + rows[i] * width, (size_t)width);
}

/* The layers' forward, as LlamaForCausalLM.forward runs it eagerly. Returns 0, or -1 when an
 * attention kernel declines the shapes or a cache slot is out of range (the caller runs the
 * step in Python: the cache rows written so far are rewritten with the same values). */
int decoder_stack(const Kernels* k, const Layer* layers, int num_layers, const Step* s) {
    const int T = s->tokens, H = s->hidden, D = s->head_dim, nt = s->num_threads, dt = s->dtype;
    const int elem = dt == DTYPE_BF16 ? 2 : 4;
    const int64_t qkv_width = layers[0].qkv.groups * 16, qk_width = (int64_t)(s->heads + s->kv_heads) * D;
    const char* v_rows = (const char*)s->qkv + (int64_t)(s->heads + s->kv_heads) * D * elem;
    const char* k_rows = (const char*)s->qk + (int64_t)s->heads * D * elem;
    int rows = T, few = s->few_rows; /* past the last attention: the rows asked for */
    for (int l = 0; l < num_layers; ++l) {
        const Layer* L = &layers[l];
        if (l == 0)
            k->norm(s->h, L->input_norm, s->x, T, H, s->eps, dt, nt);
        else
            k->add_norm(s->h, s->delta, s->h, L->input_norm, s->x, T, H, s->eps, dt, nt);
        linear(k, &L->qkv, s->x, s->qkv, T, H, s->few_rows, s);
        k->rotary(s->qkv, qkv_width, s->qk, s->cos, s->sin, T, s->heads + s->kv_heads, D, dt, nt);
        if (k->write_cache(k_rows, qk_width * elem, v_rows, qkv_width * elem, L->key_cache, L->value_cache,
                           s->slot_mapping, T, (int64_t)s->kv_heads * D * elem, s->num_slots))
            return -1;
        if (s->num_decodes &&
            k->decode(s->qk, qk_width, L->key_cache, L->value_cache, s->attn, s->tables, s->table_width, s->lens,
                      s->decode_rows, s->num_decodes, s->heads, s->kv_heads, D, s->block_size, s->scale, dt, nt))
            return -1;
        if (s->num_chunks &&
            k->prefill(s->qk, qk_width, L->key_cache, L->value_cache, s->attn, s->chunk_slots, s->slot_starts,
                       s->q_starts, s->q_lens, s->seq_lens, s->num_chunks, s->heads, s->kv_heads, D, s->scale, nt, dt))
            return -1;
        /* The last layer past its attention only for the rows asked for: a prefill chunk's
         * other rows feed no later layer (their keys and values are written above). */
        if (l == num_layers - 1 && s->output_rows) {
            keep_rows(s->attn, s->output_rows, s->num_outputs, (int64_t)s->heads * D * elem);
            keep_rows(s->h, s->output_rows, s->num_outputs, (int64_t)H * elem);
            rows = s->num_outputs, few = s->few_output_rows;
            if (rows == 0) return 0;
        }
        linear(k, &L->o, s->attn, s->delta, rows, (int64_t)s->heads * D, few, s);
        k->add_norm(s->h, s->delta, s->h, L->post_norm, s->x, rows, H, s->eps, dt, nt);
        linear(k, &L->gate_up, s->x, s->gate_up, rows, H, few, s);
        k->silu_mul(s->gate_up, s->act, rows, s->intermediate, nt, dt);
        linear(k, &L->down, s->act, s->delta, rows, s->intermediate, few, s);
    }
    k->add_norm(s->h, s->delta, s->h, s->final_norm, s->out, rows, H, s->eps, dt, nt);
    return 0;
}
