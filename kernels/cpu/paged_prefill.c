/* Paged prefill attention for CPU, float32 or bfloat16: every prefill chunk of a step against its
 * sequence's keys and values, read in place through the cache rows of its tokens, causal
 * (query i of a chunk of n sees keys 0 .. len - n + i), in one call for the whole step.
 *
 * Why: torch's route gathers each chunk's keys and values and runs a flash SDPA call per chunk
 * and layer; for the short prompts of a serving burst (16 sequences of ~130 tokens in a
 * 2,048-token step) that took a noticeable part of the step, far below the FMA peak (2-core
 * Xeon; benchmarks/RESULTS.md, "Xeon (no AMX): CPU kernels" and "Figures behind design choices
 * in the code").
 *
 * A work item is (sequence, KV head, 16 query positions): the query rows of that head's group
 * at those positions, against the keys up to the last position's, 16 keys at a time. Each key
 * tile is transposed once into dim-major order, so a query row's 16 scores are one vector
 * accumulated by broadcasting each of its elements (no sums across lanes), two tiles a step;
 * then an online softmax (running maximum and total per row, as flash attention) and the value
 * rows added into 4 rows' outputs at once (2 with head dim 128). Short sequences only
 * (kernels/cpu/paged_attention.py's native_prefill_max_keys): every item reads all the keys
 * its rows see, so long contexts, which SDPA's larger query blocks read fewer times, are
 * left to SDPA. bfloat16 queries and caches are widened to float32 as they are read (the
 * sums in float32) and the output rounded to nearest-even once; where the CPU has AVX512-BF16
 * they are multiplied as bf16 pairs instead (attend_rows_pairs: faster for the 30 layers of a
 * 2,048-token step of 10 prompts, 2-core Zen 4, benchmarks/RESULTS.md, "Zen 4: CPU kernels";
 * error within the same bound, measured 2e-3 to 6e-3 of the largest output). Built at first use by
 * kernels/cpu/native_build.py
 * (-O3 -march=native -fopenmp) and called through ctypes from kernels/cpu/paged_prefill.py.
 * With AVX2 and FMA but no AVX-512 the same items run in 8-lane vectors (attend_rows' AVX2 form:
 * one key tile a step, the output sums kept in memory, 16 registers being too few for them);
 * without AVX2 paged_prefill_available says 0, the library is not used and the caller runs
 * torch's SDPA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include "cpu_avx512.h"
#define VECTORS 1
#elif defined(__AVX2__) && defined(__FMA__)
#include "cpu_avx2.h"
#define VECTORS 1
#endif

#if defined(VECTORS)
#define TILE 16     /* keys a step, query positions an item */
#define MAX_ROWS 4  /* query rows multiplied at once: 4 (head dim 64), 2 (128; AVX2: 4): AVX-512's 16 accumulators */
#define MAX_DIM 128 /* head dims taken: 64 and 128 (dim / 16 vectors a row, dim / 8 in AVX2) */

/* kt[d * TILE + i] = key row i's element d (rows past `count` zero): a key tile dim-major. */
static inline void transpose_tile(const void* cache, const int64_t* slots, int t0, int count, int64_t token_stride,
                                  int64_t head_at, int dim, float* restrict kt, const int dtype) {
    for (int i = 0; i < TILE; ++i) {
        if (i < count) {
            const int64_t row = slots[t0 + i] * token_stride + head_at;
            for (int d = 0; d < dim; ++d) kt[d * TILE + i] = load_f32(cache, row + d, dtype);
        } else {
            for (int d = 0; d < dim; ++d) kt[d * TILE + i] = 0.f;
        }
    }
}

/* One item: query rows rows[0..n) (each a query head at a position: q points at its dim values,
 * scaled; last its last visible key), all keys 0 .. max(last). */
typedef struct {
    const float* q;
    int64_t out; /* element offset of its output row */
    int last;
} Row;

/* One past the last key any of the rows sees (at most keys). */
static inline int keys_end(const Row* rows, int n, int keys) {
    int last = 0;
    for (int r = 0; r < n; ++r) last = rows[r].last > last ? rows[r].last : last;
    return last + 1 < keys ? last + 1 : keys;
}

#if defined(__AVX512F__)
/* A call's rows' running state, as flash attention keeps it: per row the largest score so far,
 * the total of exp(score - that), and its output sums (dim / 16 vectors), rescaled as it grows. */
static inline void start_rows(int n, int nv, __m512 acc[][MAX_DIM / 16], float* top, float* total) {
    for (int r = 0; r < n; ++r) {
        top[r] = -INFINITY, total[r] = 0.f;
        for (int j = 0; j < nv; ++j) acc[r][j] = _mm512_setzero_ps();
    }
}

/* One row's step over the 2 * TILE keys from t0 (scores s0, s1, scaled): the keys it sees get
 * exp(score - its new running maximum) in e0, e1 (the others 0), its maximum and total move on
 * and its sums acc[0 .. nv) are rescaled to the new maximum. Returns 0 where it sees none. */
static inline __attribute__((always_inline)) int softmax_step(int last, int t0, __m512 s0, __m512 s1, float* top,
                                                              float* total, __m512* acc, const int nv, __m512* e0,
                                                              __m512* e1) {
    const int visible = last - t0 + 1; /* keys of this step the row sees */
    if (visible <= 0) return 0;
    const __mmask16 seen0 = visible >= TILE ? (__mmask16)0xffff : (__mmask16)((1u << visible) - 1u);
    const __mmask16 seen1 = visible >= 2 * TILE ? (__mmask16)0xffff
                            : visible > TILE  ? (__mmask16)((1u << (visible - TILE)) - 1u) : (__mmask16)0;
    float step_top = _mm512_mask_reduce_max_ps(seen0, s0);
    if (seen1) {
        const float top1 = _mm512_mask_reduce_max_ps(seen1, s1);
        step_top = top1 > step_top ? top1 : step_top;
    }
    const float new_top = step_top > *top ? step_top : *top;
    const __m512 m = _mm512_set1_ps(new_top);
    *e0 = _mm512_maskz_mov_ps(seen0, exp_nonpositive(_mm512_sub_ps(s0, m)));
    *e1 = _mm512_maskz_mov_ps(seen1, exp_nonpositive(_mm512_sub_ps(s1, m)));
    const float shrink = expf(*top - new_top); /* 0 for the first step (top -inf) */
    *total = *total * shrink + _mm512_reduce_add_ps(_mm512_add_ps(*e0, *e1));
    *top = new_top;
    const __m512 shrink_v = _mm512_set1_ps(shrink);
    for (int j = 0; j < nv; ++j) acc[j] = _mm512_mul_ps(acc[j], shrink_v);
    return 1;
}

/* Each row's sums divided by its total, written to its output row. */
static inline void finish_rows(const Row* rows, int n, int nv, __m512 acc[][MAX_DIM / 16], const float* total,
                               void* out, const int dtype) {
    for (int r = 0; r < n; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / total[r]);
        for (int j = 0; j < nv; ++j) store16(out, rows[r].out + 16 * j, _mm512_mul_ps(acc[r][j], inv), 0xffff, dtype);
    }
}

static inline __attribute__((always_inline)) void attend_rows(const Row* rows, const int n, const float* kt_all,
                                                              const void* value_cache, const int64_t* slots,
                                                              int64_t token_stride, int64_t head_at, const int dim,
                                                              int keys, void* out, const int dtype) {
    const int nv = dim / 16;
    __m512 acc[MAX_ROWS][MAX_DIM / 16];
    float top[MAX_ROWS], total[MAX_ROWS];
    start_rows(n, nv, acc, top, total);
    const int end = keys_end(rows, n, keys);
    for (int t0 = 0; t0 < end; t0 += 2 * TILE) { /* two key tiles a step: each broadcast query value feeds 2 FMAs */
        const float* kt = kt_all + (int64_t)(t0 / TILE) * dim * TILE;
        const int two = end - t0 > TILE;
        __m512 s[MAX_ROWS][2];
        for (int r = 0; r < n; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
        if (two) {
            for (int d = 0; d < dim; ++d) {
                const __m512 k0 = _mm512_loadu_ps(kt + d * TILE), k1 = _mm512_loadu_ps(kt + (dim + d) * TILE);
                for (int r = 0; r < n; ++r) {
                    const __m512 q = _mm512_set1_ps(rows[r].q[d]);
                    s[r][0] = _mm512_fmadd_ps(q, k0, s[r][0]);
                    s[r][1] = _mm512_fmadd_ps(q, k1, s[r][1]);
                }
            }
        } else {
            for (int d = 0; d < dim; ++d) {
                const __m512 k0 = _mm512_loadu_ps(kt + d * TILE);
                for (int r = 0; r < n; ++r) s[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(rows[r].q[d]), k0, s[r][0]);
            }
        }
        float p[MAX_ROWS][2 * TILE];
        for (int r = 0; r < n; ++r) {
            __m512 e0, e1;
            if (!softmax_step(rows[r].last, t0, s[r][0], s[r][1], &top[r], &total[r], acc[r], nv, &e0, &e1)) {
                memset(p[r], 0, sizeof(p[r]));
                continue;
            }
            _mm512_storeu_ps(p[r], e0);
            _mm512_storeu_ps(p[r] + TILE, e1);
        }
        const int count = end - t0 < 2 * TILE ? end - t0 : 2 * TILE;
        for (int i = 0; i < count; ++i) {
            const int64_t v = slots[t0 + i] * token_stride + head_at;
            __m512 vv[MAX_DIM / 16];
            for (int j = 0; j < nv; ++j) vv[j] = load16(value_cache, v + 16 * j, 0xffff, dtype);
            for (int r = 0; r < n; ++r) {
                const __m512 w = _mm512_set1_ps(p[r][i]);
                for (int j = 0; j < nv; ++j) acc[r][j] = _mm512_fmadd_ps(w, vv[j], acc[r][j]);
            }
        }
    }
    finish_rows(rows, n, nv, acc, total, out, dtype);
}


#if defined(__AVX512BF16__)
/* bf16 with AVX512-BF16: VDPBF16PS multiplies pairs of bf16 into float32 sums, twice an FMA's
 * work an instruction and no widening. Keys and values are copied once per (chunk, KV head)
 * into pair layouts: a key tile as kp[d / 2][16 keys][2] (one 64-byte load: 16 keys at two
 * dims, times a query row's two dims broadcast), values as vp[key / 2][dim][2] (16 dims at two
 * keys, times the row's two probabilities broadcast). The probabilities are rounded to bf16 for
 * the value products (their float32 total divides); keys past a chunk's end are zero in both. */

/* Keys t0 .. t0 + count of the tile at kp (and their values into vp, pair (t0 + i) / 2). */
static inline void pair_tiles(const uint16_t* key_cache, const uint16_t* value_cache, const int64_t* slots, int t0,
                              int count, int64_t token_stride, int64_t head_at, int dim, uint32_t* restrict kp,
                              uint16_t* restrict vp) {
    const int half = dim / 2;
    for (int i = 0; i < TILE; ++i) {
        uint16_t* v = vp + (int64_t)((t0 + i) / 2) * dim * 2 + ((t0 + i) & 1);
        if (i < count) {
            const int64_t row = slots[t0 + i] * token_stride + head_at;
            const uint32_t* k = (const uint32_t*)(key_cache + row);
            for (int p = 0; p < half; ++p) kp[p * TILE + i] = k[p];
            for (int d = 0; d < dim; ++d) v[2 * d] = value_cache[row + d];
        } else {
            for (int p = 0; p < half; ++p) kp[p * TILE + i] = 0;
            for (int d = 0; d < dim; ++d) v[2 * d] = 0;
        }
    }
}

/* attend_rows over the pair layouts: rows' q point at bf16 query rows (unscaled: `scale`
 * multiplies the scores). */
static inline __attribute__((always_inline)) void attend_rows_pairs(const Row* rows, const int n,
                                                                    const uint32_t* kp_all, const uint16_t* vp_all,
                                                                    const int dim, int keys, float scale, void* out) {
    const int nv = dim / 16, half = dim / 2;
    __m512 acc[MAX_ROWS][MAX_DIM / 16];
    float top[MAX_ROWS], total[MAX_ROWS];
    start_rows(n, nv, acc, top, total);
    const int end = keys_end(rows, n, keys);
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int t0 = 0; t0 < end; t0 += 2 * TILE) {
        const uint32_t* k0 = kp_all + (int64_t)(t0 / TILE) * half * TILE;
        const uint32_t* k1 = k0 + half * TILE;
        const int two = end - t0 > TILE;
        __m512 s[MAX_ROWS][2];
        for (int r = 0; r < n; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
        if (two) {
            for (int p = 0; p < half; ++p) {
                const __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + p * TILE);
                const __m512bh b = (__m512bh)_mm512_loadu_si512(k1 + p * TILE);
                for (int r = 0; r < n; ++r) {
                    const __m512bh q = (__m512bh)_mm512_set1_epi32((int)((const uint32_t*)rows[r].q)[p]);
                    s[r][0] = _mm512_dpbf16_ps(s[r][0], q, a);
                    s[r][1] = _mm512_dpbf16_ps(s[r][1], q, b);
                }
            }
        } else {
            for (int p = 0; p < half; ++p) {
                const __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + p * TILE);
                for (int r = 0; r < n; ++r) {
                    const __m512bh q = (__m512bh)_mm512_set1_epi32((int)((const uint32_t*)rows[r].q)[p]);
                    s[r][0] = _mm512_dpbf16_ps(s[r][0], q, a);
                }
            }
        }
        uint32_t pw[MAX_ROWS][TILE]; /* a row's probabilities of keys 2i, 2i + 1 as a bf16 pair */
        for (int r = 0; r < n; ++r) {
            const __m512 s0 = _mm512_mul_ps(s[r][0], scale_v), s1 = _mm512_mul_ps(s[r][1], scale_v);
            __m512 e0, e1;
            if (!softmax_step(rows[r].last, t0, s0, s1, &top[r], &total[r], acc[r], nv, &e0, &e1)) {
                memset(pw[r], 0, sizeof(pw[r]));
                continue;
            }
            _mm512_storeu_si512(pw[r], (__m512i)_mm512_cvtne2ps_pbh(e1, e0)); /* keys 0-15 low, 16-31 high */
        }
        const int count = end - t0 < 2 * TILE ? end - t0 : 2 * TILE;
        const uint16_t* vp = vp_all + (int64_t)(t0 / 2) * dim * 2;
        for (int i = 0; i < (count + 1) / 2; ++i) {
            __m512bh vv[MAX_DIM / 16];
            for (int j = 0; j < nv; ++j) vv[j] = (__m512bh)_mm512_loadu_si512(vp + (int64_t)i * dim * 2 + 32 * j);
            for (int r = 0; r < n; ++r) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pw[r][i]);
                for (int j = 0; j < nv; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w, vv[j]);
            }
        }
    }
    finish_rows(rows, n, nv, acc, total, out, DTYPE_BF16);
}
#define PAIRS 1
#define ATTEND_PAIRS(N, DIM) attend_rows_pairs(rows + r, N, (const uint32_t*)kt, vp, DIM, keys_seen, scale, out)
#else
#define PAIRS 0
#define ATTEND_PAIRS(N, DIM) ((void)0) /* never reached: `pairs` is 0 */
#endif

#else /* AVX2 and FMA */
/* attend_rows in 8-lane vectors: a key tile's 16 scores a row are two vectors, one tile a step
 * (2 rows x 2 vectors x 2 tiles of sums and the keys would outgrow 16 registers); the output
 * sums of the rows live in memory (dim / 8 vectors a row, 32 for 4 rows), each read and written
 * once per step around the value rows' products. */
static inline __attribute__((always_inline)) void attend_rows(const Row* rows, const int n, const float* kt_all,
                                                              const void* value_cache, const int64_t* slots,
                                                              int64_t token_stride, int64_t head_at, const int dim,
                                                              int keys, void* out, const int dtype) {
    const int nv = dim / 8;
    float acc[MAX_ROWS][MAX_DIM] __attribute__((aligned(32)));
    float top[MAX_ROWS], total[MAX_ROWS];
    for (int r = 0; r < n; ++r) {
        top[r] = -INFINITY, total[r] = 0.f;
        memset(acc[r], 0, sizeof(float) * dim);
    }
    const int end = keys_end(rows, n, keys);
    const __m256 lowest = _mm256_set1_ps(-INFINITY);
    for (int t0 = 0; t0 < end; t0 += TILE) {
        const float* kt = kt_all + (int64_t)(t0 / TILE) * dim * TILE;
        __m256 s[MAX_ROWS][2];
        for (int r = 0; r < n; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
        for (int d = 0; d < dim; ++d) {
            const __m256 k0 = _mm256_loadu_ps(kt + d * TILE), k1 = _mm256_loadu_ps(kt + d * TILE + 8);
            for (int r = 0; r < n; ++r) {
                const __m256 q = _mm256_set1_ps(rows[r].q[d]);
                s[r][0] = _mm256_fmadd_ps(q, k0, s[r][0]);
                s[r][1] = _mm256_fmadd_ps(q, k1, s[r][1]);
            }
        }
        float p[MAX_ROWS][TILE] __attribute__((aligned(32)));
        for (int r = 0; r < n; ++r) { /* softmax_step's work for one tile */
            const int visible = rows[r].last - t0 + 1;
            if (visible <= 0) {
                memset(p[r], 0, sizeof(p[r]));
                continue;
            }
            const __m256 seen0 = _mm256_castsi256_ps(lanes_below(visible));
            const __m256 seen1 = _mm256_castsi256_ps(lanes_below(visible - 8));
            const float step_top = horizontal_max(
                _mm256_max_ps(_mm256_blendv_ps(lowest, s[r][0], seen0), _mm256_blendv_ps(lowest, s[r][1], seen1)));
            const float new_top = step_top > top[r] ? step_top : top[r];
            const __m256 m = _mm256_set1_ps(new_top);
            const __m256 e0 = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(s[r][0], m)), seen0);
            const __m256 e1 = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(s[r][1], m)), seen1);
            const float shrink = expf(top[r] - new_top); /* 0 for the first step (top -inf) */
            total[r] = total[r] * shrink + horizontal_sum(_mm256_add_ps(e0, e1));
            top[r] = new_top;
            const __m256 shrink_v = _mm256_set1_ps(shrink);
            for (int j = 0; j < nv; ++j) _mm256_store_ps(acc[r] + 8 * j, _mm256_mul_ps(_mm256_load_ps(acc[r] + 8 * j), shrink_v));
            _mm256_store_ps(p[r], e0);
            _mm256_store_ps(p[r] + 8, e1);
        }
        const int count = end - t0 < TILE ? end - t0 : TILE;
        for (int j = 0; j < nv; ++j) {
            __m256 a[MAX_ROWS];
            for (int r = 0; r < n; ++r) a[r] = _mm256_load_ps(acc[r] + 8 * j);
            for (int i = 0; i < count; ++i) {
                const __m256 v = load8(value_cache, slots[t0 + i] * token_stride + head_at + 8 * j, dtype);
                for (int r = 0; r < n; ++r) a[r] = _mm256_fmadd_ps(_mm256_set1_ps(p[r][i]), v, a[r]);
            }
            for (int r = 0; r < n; ++r) _mm256_store_ps(acc[r] + 8 * j, a[r]);
        }
    }
    for (int r = 0; r < n; ++r) {
        const __m256 inv = _mm256_set1_ps(1.f / total[r]);
        for (int j = 0; j < nv; ++j) store8(out, rows[r].out + 8 * j, _mm256_mul_ps(_mm256_load_ps(acc[r] + 8 * j), inv), dtype);
    }
}
#define PAIRS 0
#define ATTEND_PAIRS(N, DIM) ((void)0) /* never reached: `pairs` is 0 */
#endif

/* the dtype as a constant in each call, so every inlined copy has its own loads and stores; bf16
 * pairs where the CPU multiplies them (`pairs`) */
#define ATTEND_ROWS(N, DIM)                                                                                      \
    (pairs ? ATTEND_PAIRS(N, DIM)                                                                                \
     : dtype == DTYPE_BF16                                                                                       \
         ? attend_rows(rows + r, N, kt, value_cache, slots, token_stride, head_at, DIM, keys_seen, out, DTYPE_BF16) \
         : attend_rows(rows + r, N, kt, value_cache, slots, token_stride, head_at, DIM, keys_seen, out, DTYPE_F32))

int paged_prefill_available(void) { return 1; }

/* query: [tokens, heads, dim] with rows q_stride elements apart; out: [tokens, heads, dim]
 * contiguous; caches: [blocks, block_size, kv_heads, dim]; all float32 or all bfloat16 (dtype,
 * cpu_dtypes.h's codes). Chunk c: query rows
 * q_starts[c] .. + q_lens[c], keys at slots[slot_starts[c] .. + seq_lens[c]] (cache rows).
 * Returns 0, or -1 where the shapes are not taken (the caller falls back). */
int paged_prefill(const void* query, int64_t q_stride, const void* key_cache, const void* value_cache, void* out,
                  const int64_t* all_slots, const int64_t* slot_starts, const int32_t* q_starts, const int32_t* q_lens,
                  const int32_t* seq_lens, int num_chunks, int heads, int kv_heads, int dim, float scale,
                  int num_threads, int dtype) {
    const int group = heads / kv_heads;
    if ((dim != 64 && dim != 128) || heads % kv_heads || group * TILE > 1024) return -1;
    int64_t items = 0;
    int* first_item = (int*)malloc(sizeof(int) * (num_chunks + 1));
    for (int c = 0; c < num_chunks; ++c) {
        first_item[c] = (int)items;
        items += (int64_t)kv_heads * ((q_lens[c] + TILE - 1) / TILE);
    }
    first_item[num_chunks] = (int)items;
    int longest = 0;
    for (int c = 0; c < num_chunks; ++c) longest = seq_lens[c] > longest ? seq_lens[c] : longest;
    const int64_t token_stride = (int64_t)kv_heads * dim;
#pragma omp parallel num_threads(num_threads)
    {
        const size_t key_steps = (size_t)(longest + 2 * TILE - 1) / (2 * TILE); /* attend_rows reads two tiles a step */
        float* kt = (float*)aligned_alloc(64, sizeof(float) * key_steps * 2 * TILE * dim);
        const int pairs = PAIRS && dtype == DTYPE_BF16; /* kt holds the key pairs then, vp the value pairs */
        uint16_t* vp = pairs ? (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * key_steps * 2 * TILE * dim) : NULL;
        float* qs = (float*)aligned_alloc(64, sizeof(float) * (size_t)group * TILE * dim);
        Row rows[1024];
        int kt_chunk = -1, kt_head = -1, kt_keys = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            int c = 0;
            while (first_item[c + 1] <= item) ++c;
            const int local = (int)(item - first_item[c]);
            const int tiles = (q_lens[c] + TILE - 1) / TILE;
            const int h = local / tiles, p0 = (local % tiles) * TILE;
            const int positions = q_lens[c] - p0 < TILE ? q_lens[c] - p0 : TILE;
            const int keys_seen = seq_lens[c] - q_lens[c] + p0 + positions; /* keys the item's last row sees */
            const int64_t* slots = all_slots + slot_starts[c];
            const int64_t head_at = (int64_t)h * dim;
            /* The key tiles, dim-major: kept while the next item reads the same (chunk, head). */
            if (kt_chunk != c || kt_head != h || kt_keys < keys_seen) {
                /* the same (chunk, head) with more keys: from its last, partial tile on */
                const int from = kt_chunk == c && kt_head == h ? kt_keys / TILE * TILE : 0;
                for (int t0 = from; t0 < keys_seen; t0 += TILE) {
                    const int count = keys_seen - t0 < TILE ? keys_seen - t0 : TILE;
#if PAIRS
                    if (pairs) {
                        pair_tiles((const uint16_t*)key_cache, (const uint16_t*)value_cache, slots, t0, count,
                                   token_stride, head_at, dim, (uint32_t*)kt + (int64_t)t0 * dim / 2, vp);
                        continue;
                    }
#endif
                    transpose_tile(key_cache, slots, t0, count, token_stride, head_at, dim, kt + (int64_t)t0 * dim,
                                   dtype);
                }
                kt_chunk = c, kt_head = h, kt_keys = keys_seen;
            }
            int n = 0;
            for (int i = 0; i < positions; ++i)
                for (int g = 0; g < group; ++g, ++n) {
                    const int64_t token = q_starts[c] + p0 + i, head = (int64_t)h * group + g;
                    float* q = qs + (int64_t)n * dim;
                    const int64_t src = token * q_stride + head * dim;
                    if (pairs)
                        rows[n].q = (const float*)((const uint16_t*)query + src); /* bf16 pairs, read in place */
                    else {
                        for (int d = 0; d < dim; ++d) q[d] = load_f32(query, src + d, dtype) * scale;
                        rows[n].q = q;
                    }
                    rows[n].out = (token * heads + head) * dim;
                    rows[n].last = seq_lens[c] - q_lens[c] + p0 + i;
                }
            int r = 0;
#define FOUR_ROWS_A_CALL(DIM)                                 \
    do {                                                      \
        for (; r + 4 <= n; r += 4) ATTEND_ROWS(4, DIM);       \
        switch (n - r) {                                      \
            case 3: ATTEND_ROWS(3, DIM); break;               \
            case 2: ATTEND_ROWS(2, DIM); break;               \
            case 1: ATTEND_ROWS(1, DIM); break;               \
            default: break;                                   \
        }                                                     \
    } while (0)
            if (dim == 64) {
                FOUR_ROWS_A_CALL(64);
            } else {
#if defined(__AVX512F__) /* two rows' sums fill the registers */
                for (; r + 2 <= n; r += 2) ATTEND_ROWS(2, 128);
                if (r < n) ATTEND_ROWS(1, 128);
#else /* the sums are in memory: four rows share each value row's loads, as at 64 (two rows a
       * call lost to SDPA: benchmarks/RESULTS.md, "Figures behind design choices in the code") */
                FOUR_ROWS_A_CALL(128);
#endif
            }
        }
        free(kt);
        free(vp);
        free(qs);
    }
    free(first_item);
    return 0;
}
#else
int paged_prefill_available(void) { return 0; }
#endif
