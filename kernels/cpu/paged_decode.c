/* Paged decode attention for CPU: every decode's keys and values read once, in place,
 * through its block table (no gathered copy), fp32 math.
 *
 * Built at first use by kernels/cpu/native_build.py with the machine's C compiler
 * (-O3 -march=native -fopenmp) and called through ctypes from kernels/cpu/paged_decode.py;
 * threads come from the OpenMP runtime torch already loaded. Per KV head, the query heads
 * of its group share each key and value row as it streams past; a work item is a whole
 * decode (all KV heads) or, with few decodes, one (decode, KV head) pair (see paged_decode).
 * Two passes: scores of every key (K read once), softmax, then the weighted sum of values
 * (V read once), each pass 16 tokens at a time with the item's KV heads in turn (see
 * PREFETCH_AHEAD). Specialised per (head_dim 64/128, group <= 8, dtype, a power-of-two block
 * size) with AVX-512 or, without it, AVX2 and FMA (vectorised exp, the cache read in place:
 * faster than the portable loop at 32 decodes on an AVX2-only EPYC, more so in bf16 than in
 * float32; benchmarks/RESULTS.md, "Figures behind design choices in the code"); a portable loop for
 * other shapes. The torch reference (kernels/paged_attention.py) is the test oracle.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dtypes.h"

#define MAX_GROUP 16
#define MAX_DIM 256

/* A row of `dim` cache values as fp32 into `dst` (the compiler vectorises both loops). */
static inline void load_row(const void* base, int64_t index, int dim, int dtype, float* restrict dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t* src = (const uint16_t*)base + index;
        for (int d = 0; d < dim; ++d) dst[d] = bf16_to_f32(src[d]);
    } else {
        const float* src = (const float*)base + index;
        for (int d = 0; d < dim; ++d) dst[d] = src[d];
    }
}

static inline float dot(const float* restrict a, const float* restrict b, int dim) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < dim; ++d) s += a[d] * b[d];
    return s;
}

/* One (decode, KV head): `group` query heads against `len` keys. `dim` is passed as a
 * constant by the callers below so the loops unroll for the common head sizes. */
static inline void attend_item(
    const void* query, const void* key_cache, const void* value_cache, void* out,
    const int32_t* table, int len, int64_t q_row, int64_t q_stride, int kv_head, int heads, int kv_heads, int dim,
    int block_size, int group, float scale, int dtype, float* restrict scores) {
    float q[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], row[MAX_DIM];
    for (int g = 0; g < group; ++g) {
        load_row(query, q_row * q_stride + ((int64_t)kv_head * group + g) * dim, dim, dtype, q[g]);
        for (int d = 0; d < dim; ++d) q[g][d] *= scale;
    }
    const int64_t token_stride = (int64_t)kv_heads * dim;
    for (int t = 0; t < len; ++t) {
        int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        load_row(key_cache, slot * token_stride + (int64_t)kv_head * dim, dim, dtype, row);
        for (int g = 0; g < group; ++g) scores[g * len + t] = dot(q[g], row, dim);
    }
    float total[MAX_GROUP];
    for (int g = 0; g < group; ++g) {
        float* s = scores + g * len;
        float top = -INFINITY;
        for (int t = 0; t < len; ++t) top = s[t] > top ? s[t] : top;
        float sum = 0.f;
        for (int t = 0; t < len; ++t) {
            s[t] = expf(s[t] - top);
            sum += s[t];
        }
        total[g] = sum;
        memset(acc[g], 0, sizeof(float) * dim);
    }
    for (int t = 0; t < len; ++t) {
        int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        load_row(value_cache, slot * token_stride + (int64_t)kv_head * dim, dim, dtype, row);
        for (int g = 0; g < group; ++g) {
            float p = scores[g * len + t];
#pragma omp simd
            for (int d = 0; d < dim; ++d) acc[g][d] += p * row[d];
        }
    }
    for (int g = 0; g < group; ++g) {
        int64_t at = (q_row * heads + (int64_t)kv_head * group + g) * dim;
        float inv = 1.f / total[g];
        if (dtype == DTYPE_BF16) {
            uint16_t* o = (uint16_t*)out + at;
            for (int d = 0; d < dim; ++d) o[d] = f32_to_bf16(acc[g][d] * inv);
        } else {
            float* o = (float*)out + at;
            for (int d = 0; d < dim; ++d) o[d] = acc[g][d] * inv;
        }
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#define MAX_FAST_GROUP 8
#define MAX_FAST_DIM 128
#define PREFETCH_AHEAD 16

/* An item reads, for each step of STEP tokens, every one of its KV heads in turn: the rows
 * of one token lie together in the cache, so the heads of a step read neighbouring memory
 * while it is at hand (one head over the whole context, then the next, read each row three
 * times from further away). Each head asks for its part of the row PREFETCH_AHEAD tokens
 * on: blocks lie anywhere, so the hardware prefetcher cannot guess the next one, and while
 * the arithmetic runs the loads would otherwise wait one after another. Both together sped
 * decode attention up, with blocks in random order and in order (48 decodes of ~265 tokens,
 * SmolLM2's shapes, 2-core Xeon); prefetching the whole row for the first head instead (more
 * lines in flight than the core tracks) or prefetching alone gained nothing. The lines go to
 * L2 (prefetcht1), not L1: on a 2-core Zen 4 that sped up 64 decodes of ~265 tokens (L1
 * prefetches of 6 lines a token, 16 tokens on, left loads waiting for fill buffers). The key
 * pass's last tokens ask for the value pass's first (`prefetch_part` on the values at
 * t - len), and a thread asks for its next item's first keys as it starts an item (`lead_in`):
 * faster at 32 decodes of 150 tokens, where item starts are frequent (benchmarks/RESULTS.md,
 * "Xeon (no AMX): CPU kernels", "Zen 4: CPU kernels" and "Figures behind design choices in the
 * code"). */
/* Where token t's row starts; block_size a power of two (attend_item_fast): by shifts, since a
 * division per row (two with the prefetch) cost a large share of the time
 * (benchmarks/RESULTS.md, "Figures behind design choices in the code"). */
static inline int64_t token_row(const int32_t* table, int t, int block_size, int64_t token_stride) {
    return ((int64_t)table[t >> __builtin_ctz(block_size)] * block_size + (t & (block_size - 1))) * token_stride;
}

static inline void prefetch_part(const void* cache, const int32_t* table, int t, int len, int block_size,
                                 int64_t token_stride, int64_t from, int elements, int dtype) {
    if (t >= len) return;
    const int size = dtype == DTYPE_BF16 ? 2 : 4;
    const char* p = (const char*)cache + (token_row(table, t, block_size, token_stride) + from) * size;
    for (int b = 0; b < elements * size; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

/* The item's work space: scores [count * group][len], the value pass's running sums
 * [count * group][dim] and the softmax totals [count * group] (see paged_decode). */
typedef struct {
    float *scores, *sums, *totals;
} Work;

static inline Work work_parts(float* work, int count, int group, int len, int dim) {
    Work w;
    w.scores = work;
    w.sums = work + (int64_t)count * group * len;
    w.totals = w.sums + (int64_t)count * group * dim;
    return w;
}

/* The specialised item ITEM for (DIM, GROUP, DTYPE), the constants it is compiled for. */
#define FAST_CASE(ITEM, DIM, GROUP, DTYPE)                                                                \
    if (dim == DIM && group == GROUP && dtype == DTYPE) {                                                 \
        ITEM(query, key_cache, value_cache, out, table, len, q_row, q_stride, first, count, heads, kv_heads,  \
             DIM, block_size, GROUP, scale, DTYPE, work);                                                 \
        return 1;                                                                                         \
    }
#define FAST_GROUPS(ITEM, DIM, DTYPE)                                                                     \
    FAST_CASE(ITEM, DIM, 1, DTYPE) FAST_CASE(ITEM, DIM, 2, DTYPE) FAST_CASE(ITEM, DIM, 3, DTYPE)           \
    FAST_CASE(ITEM, DIM, 4, DTYPE) FAST_CASE(ITEM, DIM, 5, DTYPE) FAST_CASE(ITEM, DIM, 6, DTYPE)           \
    FAST_CASE(ITEM, DIM, 7, DTYPE) FAST_CASE(ITEM, DIM, 8, DTYPE)
#define FAST_ITEMS(ITEM)                                                                                  \
    FAST_GROUPS(ITEM, 64, DTYPE_BF16) FAST_GROUPS(ITEM, 64, DTYPE_F32)                                    \
    FAST_GROUPS(ITEM, 128, DTYPE_BF16) FAST_GROUPS(ITEM, 128, DTYPE_F32)
#endif

#if defined(__AVX512F__)
#include "cpu_avx512.h"

/* The same item with AVX-512: a key row is read as dim/16 fp32 vectors (bf16 widened, or
 * with AVX512_BF16 multiplied as bf16 pairs by vdpbf16ps, products and sums in fp32),
 * each query head's 16-lane partial dot products are kept for 16 keys and summed across
 * lanes together (a transpose-add: ~3 instructions per score, not ~8), and the value pass
 * keeps the group's accumulators in registers. group and dim are constants at each call. */

static inline __mmask16 tail_mask(int remaining) {
    return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1u);
}

/* s[0..len) <- exp(s - max s); returns their sum. */
static inline float softmax_in_place(float* s, int len) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < len; t += 16)
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(len - t), s + t));
    __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top)), sum = _mm512_setzero_ps();
    for (int t = 0; t < len; t += 16) {
        __mmask16 k = tail_mask(len - t);
        __m512 e = _mm512_maskz_mov_ps(k, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m)));
        _mm512_mask_storeu_ps(s + t, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* r[i] = sum of the 16 lanes of v[i], for 16 vectors. */
static inline __m512 lane_sums(__m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

static inline __attribute__((always_inline)) void attend_item_avx512(
    const void* query, const void* key_cache, const void* value_cache, void* out,
    const int32_t* table, int len, int64_t q_row, int64_t q_stride, int first, int count, int heads, int kv_heads,
    const int dim, int block_size, const int group, float scale, const int dtype, float* restrict work) {
    const int n = dim / 16;
    const int64_t token_stride = (int64_t)kv_heads * dim;
    const Work w = work_parts(work, count, group, len, dim);
#if defined(__AVX512BF16__)
    const int pairs = dtype == DTYPE_BF16;
#else
    const int pairs = 0;
#endif
    __m512 partial[MAX_FAST_GROUP][16];
    for (int t0 = 0; t0 < len; t0 += 16) {
        for (int c = 0; c < count; ++c) {
            const int64_t head_at = (int64_t)(first + c) * dim, q_at = q_row * q_stride + (first + c) * (int64_t)group * dim;
            __m512 q[MAX_FAST_GROUP][MAX_FAST_DIM / 16];
            for (int g = 0; g < group; ++g)
                for (int j = 0; j < n; ++j) q[g][j] = load16(query, q_at + (int64_t)g * dim + 16 * j, 0xffff, dtype);
            for (int i = 0; i < 16; ++i) {
                int t = t0 + i;
                if (t >= len) {
                    for (int g = 0; g < group; ++g) partial[g][i] = _mm512_setzero_ps();
                    continue;
                }
                int64_t at = token_row(table, t, block_size, token_stride) + head_at;
                prefetch_part(key_cache, table, t + PREFETCH_AHEAD, len, block_size, token_stride, head_at, dim, dtype);
                if (t + PREFETCH_AHEAD >= len) /* the value pass's first rows */
                    prefetch_part(value_cache, table, t + PREFETCH_AHEAD - len, len, block_size, token_stride, head_at,
                                  dim, dtype);
#if defined(__AVX512BF16__)
                if (pairs) {
                    const uint16_t* k = (const uint16_t*)key_cache + at;
                    for (int g = 0; g < group; ++g) {
                        __m512 acc = _mm512_setzero_ps();
                        for (int j = 0; j < n / 2; ++j) {
                            __m512bh kk = (__m512bh)_mm512_loadu_si512(k + 32 * j);
                            __m512bh qq = (__m512bh)_mm512_loadu_si512((const uint16_t*)query + q_at + (int64_t)g * dim + 32 * j);
                            acc = _mm512_dpbf16_ps(acc, qq, kk);
                        }
                        partial[g][i] = acc;
                    }
                    continue;
                }
#endif
                __m512 k[MAX_FAST_DIM / 16];
                for (int j = 0; j < n; ++j) k[j] = load16(key_cache, at + 16 * j, 0xffff, dtype);
                for (int g = 0; g < group; ++g) {
                    __m512 acc = _mm512_mul_ps(q[g][0], k[0]);
                    for (int j = 1; j < n; ++j) acc = _mm512_fmadd_ps(q[g][j], k[j], acc);
                    partial[g][i] = acc;
                }
            }
            for (int g = 0; g < group; ++g) {
                __m512 s = _mm512_mul_ps(lane_sums(partial[g]), _mm512_set1_ps(scale));
                int valid = len - t0 < 16 ? len - t0 : 16;
                _mm512_mask_storeu_ps(w.scores + (int64_t)(c * group + g) * len + t0, (__mmask16)((1u << valid) - 1u), s);
            }
        }
    }
    (void)pairs;
    for (int s = 0; s < count * group; ++s) w.totals[s] = softmax_in_place(w.scores + (int64_t)s * len, len);
    memset(w.sums, 0, sizeof(float) * count * group * dim);
    for (int t0 = 0; t0 < len; t0 += 16) {
        const int t1 = len - t0 < 16 ? len : t0 + 16;
        for (int c = 0; c < count; ++c) {
            const int64_t head_at = (int64_t)(first + c) * dim;
            const float* p = w.scores + (int64_t)c * group * len;
            float* sum = w.sums + (int64_t)c * group * dim;
            __m512 acc[MAX_FAST_GROUP][MAX_FAST_DIM / 16];
            for (int g = 0; g < group; ++g)
                for (int j = 0; j < n; ++j) acc[g][j] = _mm512_loadu_ps(sum + g * dim + 16 * j);
            for (int t = t0; t < t1; ++t) {
                int64_t at = token_row(table, t, block_size, token_stride) + head_at;
                prefetch_part(value_cache, table, t + PREFETCH_AHEAD, len, block_size, token_stride, head_at, dim, dtype);
                __m512 v[MAX_FAST_DIM / 16];
                for (int j = 0; j < n; ++j) v[j] = load16(value_cache, at + 16 * j, 0xffff, dtype);
                for (int g = 0; g < group; ++g) {
                    __m512 weight = _mm512_set1_ps(p[(int64_t)g * len + t]);
                    for (int j = 0; j < n; ++j) acc[g][j] = _mm512_fmadd_ps(weight, v[j], acc[g][j]);
                }
            }
            for (int g = 0; g < group; ++g)
                for (int j = 0; j < n; ++j) _mm512_storeu_ps(sum + g * dim + 16 * j, acc[g][j]);
        }
    }
    for (int s = 0; s < count * group; ++s) {
        float o[MAX_FAST_DIM];
        __m512 inv = _mm512_set1_ps(1.f / w.totals[s]);
        for (int j = 0; j < n; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(w.sums + (int64_t)s * dim + 16 * j), inv));
        int64_t at = (q_row * heads + (int64_t)first * group + s) * dim;
        if (dtype == DTYPE_BF16)
            for (int d = 0; d < dim; ++d) ((uint16_t*)out)[at + d] = f32_to_bf16(o[d]);
        else
            memcpy((float*)out + at, o, sizeof(float) * dim);
    }
}

/* The specialised item for (dim, group, dtype) if there is one; 0: use the portable loop. */
static int attend_item_fast(
    const void* query, const void* key_cache, const void* value_cache, void* out,
    const int32_t* table, int len, int64_t q_row, int64_t q_stride, int first, int count, int heads, int kv_heads,
    int dim, int block_size, int group, float scale, int dtype, float* restrict work) {
    if (block_size & (block_size - 1)) return 0; /* token_row takes powers of two */
    FAST_ITEMS(attend_item_avx512)
    return 0;
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "cpu_avx2.h"

/* The same item with AVX2 and FMA (no AVX-512): 8-lane vectors, a key row read in place as
 * dim/8 of them (bf16 widened), each query head's partial dot products kept for 8 keys and
 * summed across lanes together, a vectorised exp, and the value pass accumulating in
 * vectors. group and dim are constants at each call. */

/* s[0..len) <- exp(s - max s); returns their sum. */
static inline float softmax_in_place8(float* s, int len) {
    float top = -INFINITY;
    for (int t = 0; t < len; ++t) top = s[t] > top ? s[t] : top;
    __m256 m = _mm256_set1_ps(top), sum = _mm256_setzero_ps();
    for (int t = 0; t < len; t += 8) {
        __m256i k = lanes_below(len - t);
        __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(_mm256_maskload_ps(s + t, k), m)), _mm256_castsi256_ps(k));
        _mm256_maskstore_ps(s + t, k, e);
        sum = _mm256_add_ps(sum, e);
    }
    return horizontal_sum(sum);
}

/* r[i] = sum of the 8 lanes of v[i], for 8 vectors. */
static inline __m256 lane_sums8(__m256 v[8]) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* low half: lanes 0-3 of v0..v3 | v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline __attribute__((always_inline)) void attend_item_avx2(
    const void* query, const void* key_cache, const void* value_cache, void* out,
    const int32_t* table, int len, int64_t q_row, int64_t q_stride, int first, int count, int heads, int kv_heads,
    const int dim, int block_size, const int group, float scale, const int dtype, float* restrict work) {
    const int n = dim / 8;
    const int64_t token_stride = (int64_t)kv_heads * dim;
    const Work w = work_parts(work, count, group, len, dim);
    __m256 partial[MAX_FAST_GROUP][8];
    for (int t0 = 0; t0 < len; t0 += 16) {
        for (int c = 0; c < count; ++c) {
            const int64_t head_at = (int64_t)(first + c) * dim, q_at = q_row * q_stride + (first + c) * (int64_t)group * dim;
            __m256 q[MAX_FAST_GROUP][MAX_FAST_DIM / 8];
            for (int g = 0; g < group; ++g)
                for (int j = 0; j < n; ++j)
                    q[g][j] = _mm256_mul_ps(load8(query, q_at + (int64_t)g * dim + 8 * j, dtype), _mm256_set1_ps(scale));
            for (int t8 = t0; t8 < t0 + 16 && t8 < len; t8 += 8) {
                for (int i = 0; i < 8; ++i) {
                    int t = t8 + i;
                    if (t >= len) {
                        for (int g = 0; g < group; ++g) partial[g][i] = _mm256_setzero_ps();
                        continue;
                    }
                    int64_t at = token_row(table, t, block_size, token_stride) + head_at;
                    prefetch_part(key_cache, table, t + PREFETCH_AHEAD, len, block_size, token_stride, head_at, dim, dtype);
                    if (t + PREFETCH_AHEAD >= len) /* the value pass's first rows */
                        prefetch_part(value_cache, table, t + PREFETCH_AHEAD - len, len, block_size, token_stride, head_at,
                                      dim, dtype);
                    __m256 k[MAX_FAST_DIM / 8];
                    for (int j = 0; j < n; ++j) k[j] = load8(key_cache, at + 8 * j, dtype);
                    for (int g = 0; g < group; ++g) {
                        __m256 acc = _mm256_mul_ps(q[g][0], k[0]);
                        for (int j = 1; j < n; ++j) acc = _mm256_fmadd_ps(q[g][j], k[j], acc);
                        partial[g][i] = acc;
                    }
                }
                __m256i valid = lanes_below(len - t8);
                for (int g = 0; g < group; ++g)
                    _mm256_maskstore_ps(w.scores + (int64_t)(c * group + g) * len + t8, valid, lane_sums8(partial[g]));
            }
        }
    }
    for (int s = 0; s < count * group; ++s) w.totals[s] = softmax_in_place8(w.scores + (int64_t)s * len, len);
    memset(w.sums, 0, sizeof(float) * count * group * dim);
    for (int t0 = 0; t0 < len; t0 += 16) {
        const int t1 = len - t0 < 16 ? len : t0 + 16;
        for (int c = 0; c < count; ++c) {
            const int64_t head_at = (int64_t)(first + c) * dim;
            const float* p = w.scores + (int64_t)c * group * len;
            float* sum = w.sums + (int64_t)c * group * dim;
            __m256 acc[MAX_FAST_GROUP][MAX_FAST_DIM / 8];
            for (int g = 0; g < group; ++g)
                for (int j = 0; j < n; ++j) acc[g][j] = _mm256_loadu_ps(sum + g * dim + 8 * j);
            for (int t = t0; t < t1; ++t) {
                int64_t at = token_row(table, t, block_size, token_stride) + head_at;
                prefetch_part(value_cache, table, t + PREFETCH_AHEAD, len, block_size, token_stride, head_at, dim, dtype);
                __m256 v[MAX_FAST_DIM / 8];
                for (int j = 0; j < n; ++j) v[j] = load8(value_cache, at + 8 * j, dtype);
                for (int g = 0; g < group; ++g) {
                    __m256 weight = _mm256_set1_ps(p[(int64_t)g * len + t]);
                    for (int j = 0; j < n; ++j) acc[g][j] = _mm256_fmadd_ps(weight, v[j], acc[g][j]);
                }
            }
            for (int g = 0; g < group; ++g)
                for (int j = 0; j < n; ++j) _mm256_storeu_ps(sum + g * dim + 8 * j, acc[g][j]);
        }
    }
    for (int s = 0; s < count * group; ++s) {
        float o[MAX_FAST_DIM];
        __m256 inv = _mm256_set1_ps(1.f / w.totals[s]);
        for (int j = 0; j < n; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(w.sums + (int64_t)s * dim + 8 * j), inv));
        int64_t at = (q_row * heads + (int64_t)first * group + s) * dim;
        if (dtype == DTYPE_BF16)
            for (int d = 0; d < dim; ++d) ((uint16_t*)out)[at + d] = f32_to_bf16(o[d]);
        else
            memcpy((float*)out + at, o, sizeof(float) * dim);
    }
}

/* The specialised item for (dim, group, dtype) if there is one; 0: use the portable loop. */
static int attend_item_fast(
    const void* query, const void* key_cache, const void* value_cache, void* out,
    const int32_t* table, int len, int64_t q_row, int64_t q_stride, int first, int count, int heads, int kv_heads,
    int dim, int block_size, int group, float scale, int dtype, float* restrict work) {
    if (block_size & (block_size - 1)) return 0; /* token_row takes powers of two */
    FAST_ITEMS(attend_item_avx2)
    return 0;
}
#else
static int attend_item_fast(
    const void* query, const void* key_cache, const void* value_cache, void* out,
    const int32_t* table, int len, int64_t q_row, int64_t q_stride, int first, int count, int heads, int kv_heads,
    int dim, int block_size, int group, float scale, int dtype, float* restrict work) {
    return 0;
}
#endif

/* The first keys of work item `item` (see paged_decode) into L2: a thread asks as it starts the
 * item before it, so the new item's first loads find them (the fast items' prefetching only
 * reaches ahead within an item). */
static void lead_in(const void* key_cache, const int32_t* tables, int64_t table_width, const int32_t* lens, int item,
                    int per_item, int kv_heads, int dim, int block_size, int dtype) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    const int i = item * per_item / kv_heads, first = item * per_item % kv_heads;
    if (block_size & (block_size - 1)) return; /* token_row takes powers of two */
    for (int t = 0; t < PREFETCH_AHEAD && t < lens[i]; ++t)
        prefetch_part(key_cache, tables + (int64_t)i * table_width, t, lens[i], block_size, (int64_t)kv_heads * dim,
                      (int64_t)first * dim, per_item * dim, dtype);
#else
    (void)key_cache, (void)tables, (void)table_width, (void)lens, (void)item, (void)per_item, (void)kv_heads, (void)dim,
        (void)block_size, (void)dtype;
#endif
}

/* query: [tokens, heads, dim] with rows q_stride elements apart (a view of the fused
 * projection's output), out: [tokens, heads, dim] contiguous; caches: [blocks, block_size, kv_heads, dim];
 * tables: [num_decodes, table_width] (this step's decodes only); lens, rows: per decode.
 * Returns 0, or -1 when a shape is beyond the fixed buffers (the caller falls back). */
int paged_decode(
    const void* query, int64_t q_stride, const void* key_cache, const void* value_cache, void* out,
    const int32_t* tables, int64_t table_width, const int32_t* lens, const int64_t* rows,
    int num_decodes, int heads, int kv_heads, int dim, int block_size, float scale, int dtype,
    int num_threads) {
    int group = heads / kv_heads;
    if (group > MAX_GROUP || dim > MAX_DIM || heads % kv_heads) return -1;
    /* Work items: whole decodes (all KV heads, rows read whole) when there are enough of
     * them to share out, else (decode, KV head) pairs so a few long decodes still use
     * every thread. */
    int per_item = num_decodes >= 2 * num_threads ? kv_heads : 1;
    int items = num_decodes * (kv_heads / per_item);
    int counter = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float* work = NULL;
        int64_t capacity = 0;
        /* items one at a time from a shared counter, each thread claiming its next as it starts one */
        int item = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
        while (item < items) {
            const int next = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
            if (next < items)
                lead_in(key_cache, tables, table_width, lens, next, per_item, kv_heads, dim, block_size, dtype);
            int i = item * per_item / kv_heads, len = lens[i], first = item * per_item % kv_heads;
            int64_t need = (int64_t)per_item * group * (len + dim + 1);
            if (need > capacity) {
                free(work);
                capacity = need;
                work = (float*)malloc(sizeof(float) * capacity);
            }
            const int32_t* table = tables + (int64_t)i * table_width;
            if (!attend_item_fast(query, key_cache, value_cache, out, table, len, rows[i], q_stride, first, per_item,
                                  heads, kv_heads, dim, block_size, group, scale, dtype, work))
                for (int h = first; h < first + per_item; ++h)
                    attend_item(query, key_cache, value_cache, out, table, len, rows[i], q_stride, h, heads, kv_heads,
                                dim, block_size, group, scale, dtype, work);
            item = next;
        }
        free(work);
    }
    return 0;
}
