/* float32 matmuls on CPU for a weight stored as a GGUF checkpoint stores it: y = x @ W^T (+ bias).
 *
 * W comes in blocks of 32 inputs of a row, each d * q + m with d and m fp16 values: Q4_1 (q 4-bit,
 * 16 bytes a block: byte j holds input j in its low nibble and j + 16 in its high one) or Q8_0
 * (q int8, 32 bytes, m 0). d * q is exact in float32 (an 11-bit d times a 4- or 8-bit q), so
 * fma(d, q, m) rounds once, as the float32 weight it was read from did: the weights are bit for
 * bit the float32 ones, in a sixth (Q4_1) or a third (Q8_0) of the bytes, and only the order of
 * the sums differs from torch's (tests/kernels/test_block_matmul_cpu.py bounds it).
 *
 * Two loops, by row count (kernels/block_matmul_cpu.py):
 * - up to GEMV_UP_TO rows (a few decoding sequences): each output's blocks are expanded in
 *   registers and multiplied by every row at once, so the weights stream from memory once;
 *   bound by memory, a sixth of the bytes is what makes it fast.
 * - more rows: bound by arithmetic. Six outputs' weights are expanded once into a scratch in
 *   L1 (up to KC_MAX inputs at a time), then every pair of rows is multiplied by them with
 *   twelve AVX2 accumulators (2 rows x 6 outputs, 8 inputs a lane) that never leave their
 *   registers: 8 loads feed 12 FMAs, so the FMA units, not the loads, set the pace. oneDNN's
 *   packed float32 kernel reached ~50% of this CPU's FMA peak at 32 rows, this loop ~75%
 *   (2-core AVX2 EPYC; benchmarks/cpu_matmul.py). With AVX-512 the tile is 4 rows x 6 outputs
 *   of 16 lanes (24 of its 32 registers; 10 loads feed 24 FMAs): on a 2-core Xeon it went
 *   from 127 to 210 GFLOP/s at 32 rows, ahead of oneDNN and MKL up to 128 rows, behind them
 *   (~0.9x) at 512. Rows go MC at a time, so the rows being multiplied stay in L2 while the
 *   weights pass.
 * Built at first use by kernels/native_build.py (-O3 -march=native -fopenmp); threads split the
 * outputs.
 */
#include <math.h>
#include <stdint.h>

#define GEMV_ROWS 8 /* kernels/block_matmul_cpu.py's GEMV_ROWS */
#define TILE_OUT 6  /* outputs a tile of the GEMM multiplies at once */
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TILE_ROWS 4 /* rows it multiplies at once: 4 x 6 accumulators of AVX-512's 32 registers */
#else
#define TILE_ROWS 2 /* 2 x 6 of AVX2's 16 */
#endif
#define KC_MAX 768  /* inputs of the scratch: 6 x 768 floats, 18 KB of the 32 KB L1 */
#define MC 128      /* rows the GEMM multiplies per pass over the weights (128 x 768 floats: 384 KB of L2) */
enum { BLOCK_Q4_1 = 0, BLOCK_Q8_0 = 1 }; /* kernels/block_matmul_cpu.py's BLOCK_KINDS */

/* Rows up to which the few-row loop beats the GEMM: AVX2's GEMM wins only past 8 (2-core EPYC),
 * AVX-512's from 3 (decoder linears on a 2-core Xeon: 3 rows 8.5 vs 9.8 ms, 8 rows 12.6 vs 16.1). */
#if TILE_ROWS == 4
#define GEMV_UP_TO 2
#else
#define GEMV_UP_TO GEMV_ROWS
#endif

static inline int block_bytes(int kind) { return kind == BLOCK_Q8_0 ? 32 : 16; }

#if defined(__AVX2__) && defined(__FMA__)
#include "cpu_avx2.h"

/* The 32 weights of one block as four 8-lane vectors. */
static inline void dequantize_block(const uint8_t* restrict q, float d, float m, __m256 w[4], const int kind) {
    __m256i v[4];
    if (kind == BLOCK_Q8_0) {
        const __m128i a = _mm_loadu_si128((const __m128i*)q), b = _mm_loadu_si128((const __m128i*)(q + 16));
        v[0] = _mm256_cvtepi8_epi32(a), v[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8));
        v[2] = _mm256_cvtepi8_epi32(b), v[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    } else {
        const __m128i bytes = _mm_loadu_si128((const __m128i*)q), low = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        v[0] = _mm256_cvtepu8_epi32(lo), v[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
        v[2] = _mm256_cvtepu8_epi32(hi), v[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
    }
    const __m256 dd = _mm256_set1_ps(d), mm = _mm256_set1_ps(m);
    for (int k = 0; k < 4; ++k) w[k] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(v[k]), mm);
}

/* The 32 weights of one block into dst (the GEMM's scratch): with AVX-512 in two 16-lane
 * halves, half the instructions of four 8-lane ones (the expansion is ~20% of a 32-row GEMM). */
static inline void dequantize_block_to(const uint8_t* restrict q, float d, float m, float* restrict dst,
                                       const int kind) {
#if defined(__AVX512F__)
    __m512i v[2];
    if (kind == BLOCK_Q8_0) {
        v[0] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q));
        v[1] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)));
    } else {
        const __m128i bytes = _mm_loadu_si128((const __m128i*)q), low = _mm_set1_epi8(0x0f);
        v[0] = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, low));
        v[1] = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    }
    const __m512 dd = _mm512_set1_ps(d), mm = _mm512_set1_ps(m);
    for (int k = 0; k < 2; ++k) _mm512_storeu_ps(dst + 16 * k, _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(v[k]), mm));
#else
    __m256 w[4];
    dequantize_block(q, d, m, w, kind);
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(dst + 8 * k, w[k]);
#endif
}

/* y[r, o] for ROWS rows (ROWS and kind constants at each call, so the accumulators stay in
 * registers): four per row for one row, two for two, one each for more (the rows' chains overlap). */
static inline __attribute__((always_inline)) void gemv_output(
    const float* x, const uint8_t* q, const float* d, const float* m, int64_t in, int64_t o, float* y, int64_t out,
    const int ROWS, const int kind) {
    const int lanes = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;
    __m256 acc[GEMV_ROWS][4];
    for (int r = 0; r < ROWS; ++r)
        for (int k = 0; k < lanes; ++k) acc[r][k] = _mm256_setzero_ps();
    const int64_t blocks = in / 32;
    for (int64_t b = 0; b < blocks; ++b) {
        __m256 w[4];
        dequantize_block(q + (o * blocks + b) * block_bytes(kind), d[o * blocks + b], m[o * blocks + b], w, kind);
        for (int r = 0; r < ROWS; ++r)
            for (int k = 0; k < 4; ++k)
                acc[r][k % lanes] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * in + b * 32 + 8 * k), w[k], acc[r][k % lanes]);
    }
    for (int r = 0; r < ROWS; ++r) {
        __m256 total = acc[r][0];
        for (int k = 1; k < lanes; ++k) total = _mm256_add_ps(total, acc[r][k]);
        y[r * out + o] = horizontal_sum(total);
    }
}

/* The GEMM's vectors: 16 lanes with AVX-512 (32 registers hold a 4 x 6 tile), else 8. */
#if defined(__AVX512F__)
typedef __m512 tile_vec;
#define TILE_LANES 16
static inline tile_vec tile_zero(void) { return _mm512_setzero_ps(); }
static inline tile_vec tile_load(const float* p) { return _mm512_loadu_ps(p); }
static inline tile_vec tile_fma(tile_vec a, tile_vec b, tile_vec c) { return _mm512_fmadd_ps(a, b, c); }
/* The lane sums of eight vectors at once: halving all of them together takes a third of the
 * shuffles of summing each alone, and a tile's sums were ~30% of its time at 576 inputs. */
static inline void sum8(const __m512 v[8], float out[8]) {
    __m512 half[4], quarter[2];
    for (int i = 0; i < 4; ++i) /* two vectors a register, 8 partial sums each */
        half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 2; ++i) /* four a register, 4 each: vector 4 * i + j in 128-bit lane j */
        quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0x88),
                                   _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0xdd));
    __m512 t = _mm512_add_ps(_mm512_unpacklo_ps(quarter[0], quarter[1]), _mm512_unpackhi_ps(quarter[0], quarter[1]));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
    float lanes[16]; /* lane j's elements 0 and 1: the sums of vectors j and j + 4 */
    _mm512_storeu_ps(lanes, t);
    for (int j = 0; j < 4; ++j) out[j] = lanes[4 * j], out[j + 4] = lanes[4 * j + 1];
}

/* out[i] = the sum of v[i]'s lanes, i < count (a constant at each call). */
static inline __attribute__((always_inline)) void tile_reduce(const tile_vec* v, const int count, float* out) {
    for (int g = 0; g < count; g += 8) {
        __m512 eight[8];
        float sums[8];
        for (int i = 0; i < 8; ++i) eight[i] = g + i < count ? v[g + i] : _mm512_setzero_ps();
        sum8(eight, sums);
        for (int i = 0; i < 8 && g + i < count; ++i) out[g + i] = sums[i];
    }
}
#else
typedef __m256 tile_vec;
#define TILE_LANES 8
static inline tile_vec tile_zero(void) { return _mm256_setzero_ps(); }
static inline tile_vec tile_load(const float* p) { return _mm256_loadu_ps(p); }
static inline tile_vec tile_fma(tile_vec a, tile_vec b, tile_vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) void tile_reduce(const tile_vec* v, const int count, float* out) {
    for (int i = 0; i < count; ++i) out[i] = horizontal_sum(v[i]);
}
#endif

/* sums[r * OUTS + n] = x_r . w_n over `len` inputs (a multiple of 32) for ROWS rows of x (row
 * stride x_stride) and OUTS scratch rows of w (stride w_stride): the GEMM's tile. */
static inline __attribute__((always_inline)) void tile_sums(const float* x, int64_t x_stride, const float* w,
                                                            int64_t w_stride, int64_t len, float* sums,
                                                            const int ROWS, const int OUTS) {
    tile_vec acc[TILE_ROWS * TILE_OUT];
    for (int i = 0; i < ROWS * OUTS; ++i) acc[i] = tile_zero();
    for (int64_t k = 0; k < len; k += TILE_LANES) {
        tile_vec xv[TILE_ROWS];
        for (int r = 0; r < ROWS; ++r) xv[r] = tile_load(x + r * x_stride + k);
        for (int n = 0; n < OUTS; ++n) {
            tile_vec wv = tile_load(w + n * w_stride + k);
            /* Keep wv in a register for every row: folded into each FMA as a memory operand, it
             * is loaded once per row, and the loads, not the FMAs, would set the pace. */
            __asm__("" : "+v"(wv));
            for (int r = 0; r < ROWS; ++r) acc[r * OUTS + n] = tile_fma(xv[r], wv, acc[r * OUTS + n]);
        }
    }
    tile_reduce(acc, ROWS * OUTS, sums);
}
#else
/* Without AVX2 and FMA: plain loops, which the compiler vectorises as it can. */
static inline void dequantize_block_to(const uint8_t* restrict q, float d, float m, float* restrict dst,
                                       const int kind) {
    for (int j = 0; j < 16; ++j) {
        dst[j] = fmaf(d, kind == BLOCK_Q8_0 ? (float)(int8_t)q[j] : (float)(q[j] & 0x0f), m);
        dst[j + 16] = fmaf(d, kind == BLOCK_Q8_0 ? (float)(int8_t)q[j + 16] : (float)(q[j] >> 4), m);
    }
}

static inline __attribute__((always_inline)) void gemv_output(
    const float* x, const uint8_t* q, const float* d, const float* m, int64_t in, int64_t o, float* y, int64_t out,
    const int ROWS, const int kind) {
    const int64_t blocks = in / 32;
    float sum[GEMV_ROWS] = {0.f};
    for (int64_t b = 0; b < blocks; ++b) {
        float w[32];
        dequantize_block_to(q + (o * blocks + b) * block_bytes(kind), d[o * blocks + b], m[o * blocks + b], w, kind);
        for (int r = 0; r < ROWS; ++r) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int j = 0; j < 32; ++j) s += x[r * in + b * 32 + j] * w[j];
            sum[r] += s;
        }
    }
    for (int r = 0; r < ROWS; ++r) y[r * out + o] = sum[r];
}

static inline void tile_sums(const float* x, int64_t x_stride, const float* w, int64_t w_stride, int64_t len,
                             float* sums, const int ROWS, const int OUTS) {
    for (int r = 0; r < ROWS; ++r)
        for (int n = 0; n < OUTS; ++n) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < len; ++k) s += x[r * x_stride + k] * w[n * w_stride + k];
            sums[r * OUTS + n] = s;
        }
}
#endif

#define GEMV_ROWS_CASES(KIND)                                                    \
    switch (rows) {                                                              \
        case 1: gemv_output(x, q, d, m, in, o, y, out, 1, KIND); break;          \
        case 2: gemv_output(x, q, d, m, in, o, y, out, 2, KIND); break;          \
        case 3: gemv_output(x, q, d, m, in, o, y, out, 3, KIND); break;          \
        case 4: gemv_output(x, q, d, m, in, o, y, out, 4, KIND); break;          \
        case 5: gemv_output(x, q, d, m, in, o, y, out, 5, KIND); break;          \
        case 6: gemv_output(x, q, d, m, in, o, y, out, 6, KIND); break;          \
        case 7: gemv_output(x, q, d, m, in, o, y, out, 7, KIND); break;          \
        default: gemv_output(x, q, d, m, in, o, y, out, 8, KIND); break;         \
    }

static void block_gemv(const float* x, const uint8_t* q, const float* d, const float* m, const float* bias, float* y,
                       int rows, int64_t in, int64_t out, int kind, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (out * in >= 65536) schedule(static)
    for (int64_t o = 0; o < out; ++o) {
        if (kind == BLOCK_Q8_0) {
            GEMV_ROWS_CASES(BLOCK_Q8_0)
        } else {
            GEMV_ROWS_CASES(BLOCK_Q4_1)
        }
        if (bias)
            for (int r = 0; r < rows; ++r) y[r * out + o] += bias[o];
    }
}

/* One tile's sums (ROWS rows, OUTS outputs, constants) added to y where `accumulate` (a later
 * chunk of the inputs), and the bias where given (the last chunk). */
static inline __attribute__((always_inline)) void tile(const float* x, int64_t x_stride, const float* w,
                                                       int64_t w_stride, int64_t len, float* y, int64_t out,
                                                       int accumulate, const float* bias, const int ROWS,
                                                       const int OUTS) {
    float sums[TILE_ROWS * TILE_OUT];
    tile_sums(x, x_stride, w, w_stride, len, sums, ROWS, OUTS);
    for (int r = 0; r < ROWS; ++r)
        for (int n = 0; n < OUTS; ++n)
            y[r * out + n] = sums[r * OUTS + n] + (accumulate ? y[r * out + n] : 0.f) + (bias ? bias[n] : 0.f);
}

/* Every row of x (row stride x_stride) times one scratch panel of OUTS outputs (constant). */
static inline __attribute__((always_inline)) void panel_rows(const float* x, int64_t x_stride, int rows,
                                                             const float* w, int64_t w_stride, int64_t len, float* y,
                                                             int64_t out, int accumulate, const float* bias,
                                                             const int OUTS) {
    int r = 0;
    for (; r + TILE_ROWS <= rows; r += TILE_ROWS)
        tile(x + r * x_stride, x_stride, w, w_stride, len, y + r * out, out, accumulate, bias, TILE_ROWS, OUTS);
    if (TILE_ROWS > 2 && r + 2 <= rows) { /* the last few rows: a pair, then one */
        tile(x + r * x_stride, x_stride, w, w_stride, len, y + r * out, out, accumulate, bias, 2, OUTS);
        r += 2;
    }
    if (r < rows) tile(x + r * x_stride, x_stride, w, w_stride, len, y + r * out, out, accumulate, bias, 1, OUTS);
}

static void block_gemm(const float* x, const uint8_t* q, const float* d, const float* m, const float* bias, float* y,
                       int rows, int64_t in, int64_t out, int kind, int num_threads) {
    const int64_t blocks = in / 32, bytes = block_bytes(kind);
    const int64_t chunks = (in + KC_MAX - 1) / KC_MAX, chunk = (blocks + chunks - 1) / chunks * 32; /* even chunks */
    const int64_t panels = (out + TILE_OUT - 1) / TILE_OUT;
#pragma omp parallel num_threads(num_threads) if (out * in >= 65536)
    {
        float scratch[TILE_OUT * KC_MAX] __attribute__((aligned(64)));
        for (int r0 = 0; r0 < rows; r0 += MC) {
            const int pass_rows = rows - r0 < MC ? rows - r0 : MC;
            /* Handed out 16 panels at a time, not halved up front: on a 2-core machine serving
             * requests, another process (the relay, tritonserver) takes a core now and then, and a
             * static half would leave the other thread waiting at the barrier. With a process
             * taking ~17% of a core: 32 rows 61 vs 73 ms, 64 rows 152 vs 218 (static); alone, the
             * same within noise. */
#pragma omp for schedule(dynamic, 16)
            for (int64_t p = 0; p < panels; ++p) {
                const int64_t o0 = p * TILE_OUT, outs = out - o0 < TILE_OUT ? out - o0 : TILE_OUT;
                for (int64_t k0 = 0; k0 < in; k0 += chunk) {
                    const int64_t len = in - k0 < chunk ? in - k0 : chunk;
                    for (int64_t n = 0; n < outs; ++n)
                        for (int64_t b = k0 / 32; b < (k0 + len) / 32; ++b) {
                            const int64_t at = (o0 + n) * blocks + b;
                            dequantize_block_to(q + at * bytes, d[at], m[at], scratch + n * chunk + (b * 32 - k0), kind);
                        }
                    const float* xs = x + (int64_t)r0 * in + k0;
                    float* ys = y + (int64_t)r0 * out + o0;
                    const float* last_bias = bias && k0 + len == in ? bias + o0 : 0;
                    switch (outs) {
                        case 6: panel_rows(xs, in, pass_rows, scratch, chunk, len, ys, out, k0 > 0, last_bias, 6); break;
                        case 5: panel_rows(xs, in, pass_rows, scratch, chunk, len, ys, out, k0 > 0, last_bias, 5); break;
                        case 4: panel_rows(xs, in, pass_rows, scratch, chunk, len, ys, out, k0 > 0, last_bias, 4); break;
                        case 3: panel_rows(xs, in, pass_rows, scratch, chunk, len, ys, out, k0 > 0, last_bias, 3); break;
                        case 2: panel_rows(xs, in, pass_rows, scratch, chunk, len, ys, out, k0 > 0, last_bias, 2); break;
                        default: panel_rows(xs, in, pass_rows, scratch, chunk, len, ys, out, k0 > 0, last_bias, 1); break;
                    }
                }
            }
        }
    }
}

/* y[r, o] = sum_i x[r, i] * W[o, i] + (bias ? bias[o] : 0) for W in blocks of `kind` (above);
 * x [rows, in], y [rows, out] contiguous float32; q: [out, in / 32 * block bytes], d, m: [out, in / 32];
 * in a multiple of 32. */
void block_matmul_f32(const float* x, const uint8_t* q, const float* d, const float* m, const float* bias, float* y,
                      int rows, int64_t in, int64_t out, int kind, int num_threads) {
    if (rows <= GEMV_UP_TO)
        block_gemv(x, q, d, m, bias, y, rows, in, out, kind, num_threads);
    else
        block_gemm(x, q, d, m, bias, y, rows, in, out, kind, num_threads);
}
