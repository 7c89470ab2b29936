/* Matrix-vector products on CPU for float32 weights: y = x @ W^T (+ bias) for a few rows of x.
 *
 * Why: one decoding sequence multiplies one row by every weight of the model, so its step
 * is bound by how fast the weights stream from memory. On a 2-core AVX2 AMD EPYC, oneDNN's
 * packed float32 matmul read them at ~18 GB/s at one row and MKL at ~13-16, against ~25 for
 * this loop over the weight as the checkpoint stores it ([out, in], each output a dot
 * product of contiguous memory) and ~30 for a plain sum (benchmarks/RESULTS.md).
 * Four weight rows go at a time, with two accumulators each to hide the FMA latency; the
 * few input rows of a call reuse those weight rows while they are in L1, so a call of up
 * to GEMV_MAX_ROWS (kernels/gemv_cpu.py) rows streams W once.
 * Built at first use by kernels/native_build.py (-O3 -march=native -fopenmp); threads split
 * the output rows. The sums run in another order than MKL's or oneDNN's: float32 rounding
 * differences only (tests/kernels/test_gemv_cpu.py bounds them).
 */
#include <math.h>
#include <stdint.h>

/* out[j] += dot(x[start:], w_j[start:]) for the four rows w_j of w (each `in` long). */
static inline void dot4_from(const float* restrict x, const float* restrict w, int64_t in, int64_t start,
                             float* restrict out) {
    const float *w0 = w, *w1 = w + in, *w2 = w + 2 * in, *w3 = w + 3 * in;
    float s0 = out[0], s1 = out[1], s2 = out[2], s3 = out[3];
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = start; i < in; ++i) {
        s0 += x[i] * w0[i];
        s1 += x[i] * w1[i];
        s2 += x[i] * w2[i];
        s3 += x[i] * w3[i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* out[0..3] = dot(x, w_j) for the four rows w_j of w: 16 columns a step in AVX2 registers. */
static inline void dot4(const float* restrict x, const float* restrict w, int64_t in, float* restrict out) {
    const float *w0 = w, *w1 = w + in, *w2 = w + 2 * in, *w3 = w + 3 * in;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
        __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w0 + i), a0);
        b0 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w0 + i + 8), b0);
        a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w1 + i), a1);
        b1 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w1 + i + 8), b1);
        a2 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w2 + i), a2);
        b2 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w2 + i + 8), b2);
        a3 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w3 + i), a3);
        b3 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w3 + i + 8), b3);
    }
    out[0] = horizontal_sum(_mm256_add_ps(a0, b0)), out[1] = horizontal_sum(_mm256_add_ps(a1, b1));
    out[2] = horizontal_sum(_mm256_add_ps(a2, b2)), out[3] = horizontal_sum(_mm256_add_ps(a3, b3));
    dot4_from(x, w, in, i, out);
}
#else
/* Without AVX2 and FMA: the loop above, which the compiler vectorises as it can. */
static inline void dot4(const float* restrict x, const float* restrict w, int64_t in, float* restrict out) {
    out[0] = out[1] = out[2] = out[3] = 0.f;
    dot4_from(x, w, in, 0, out);
}
#endif

static inline float dot1(const float* restrict x, const float* restrict w, int64_t in) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < in; ++i) s += x[i] * w[i];
    return s;
}

/* y[r, o] = sum_i x[r, i] * w[o, i] + (bias ? bias[o] : 0), x [rows, in], w [out, in], y [rows, out],
 * all contiguous float32. */
void gemv_f32(const float* x, const float* w, const float* bias, float* y, int rows, int64_t in, int64_t out,
              int num_threads) {
    const int64_t groups = (out + 3) / 4;
#pragma omp parallel for num_threads(num_threads) if (out * in >= 65536) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * 4;
        for (int r = 0; r < rows; ++r) {
            const float* xr = x + (int64_t)r * in;
            float* yr = y + (int64_t)r * out;
            if (first + 4 <= out) {
                dot4(xr, w + first * in, in, yr + first);
            } else {
                for (int64_t o = first; o < out; ++o) yr[o] = dot1(xr, w + o * in, in);
            }
            if (bias)
                for (int64_t o = first; o < first + 4 && o < out; ++o) yr[o] += bias[o];
        }
    }
}

/* The same product for a weight stored as a GGUF checkpoint stores it, in blocks of 32 inputs
 * of a row, each d * q + m with d and m fp16 values: Q4_1 (q 4-bit, 16 bytes a block: byte j
 * holds input j in its low nibble and j + 16 in its high one) or Q8_0 (q int8, 32 bytes, m 0).
 * d * q is exact in float32 (an 11-bit d times a 4- or 8-bit q), so fma(d, q, m) rounds once,
 * as the float32 weight it was read from did: the weights are bit for bit the float32 ones,
 * in a sixth (Q4_1) or a third (Q8_0) of the bytes, and only the order of the sums differs. */
#define BLOCK_MAX_ROWS 8 /* kernels/gemv_cpu.py's BLOCK_MAX_ROWS */
enum { BLOCK_Q4_1 = 0, BLOCK_Q8_0 = 1 }; /* kernels/gemv_cpu.py's BLOCK_KINDS */

static inline int block_bytes(int kind) { return kind == BLOCK_Q8_0 ? 32 : 16; }

#if defined(__AVX2__) && defined(__FMA__)
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

/* y[r, o] for ROWS rows (ROWS and kind constants at each call, so the accumulators stay in
 * registers): four per row for one row, two for two, one each for more (the rows' chains overlap). */
static inline __attribute__((always_inline)) void block_row(
    const float* x, const uint8_t* q, const float* d, const float* m, int64_t in, int64_t o, float* y, int64_t out,
    const int ROWS, const int kind) {
    const int lanes = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;
    __m256 acc[BLOCK_MAX_ROWS][4];
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
#else
static inline __attribute__((always_inline)) void block_row(
    const float* x, const uint8_t* q, const float* d, const float* m, int64_t in, int64_t o, float* y, int64_t out,
    const int ROWS, const int kind) {
    const int64_t blocks = in / 32;
    float sum[BLOCK_MAX_ROWS] = {0.f};
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* qb = q + (o * blocks + b) * block_bytes(kind);
        const float db = d[o * blocks + b], mb = m[o * blocks + b];
        float w[32];
        for (int j = 0; j < 16; ++j) {
            w[j] = fmaf(db, kind == BLOCK_Q8_0 ? (float)(int8_t)qb[j] : (float)(qb[j] & 0x0f), mb);
            w[j + 16] = fmaf(db, kind == BLOCK_Q8_0 ? (float)(int8_t)qb[j + 16] : (float)(qb[j] >> 4), mb);
        }
        for (int r = 0; r < ROWS; ++r) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int j = 0; j < 32; ++j) s += x[r * in + b * 32 + j] * w[j];
            sum[r] += s;
        }
    }
    for (int r = 0; r < ROWS; ++r) y[r * out + o] = sum[r];
}
#endif

#define BLOCK_ROWS_CASES(KIND)                                                   \
    switch (rows) {                                                              \
        case 1: block_row(x, q, d, m, in, o, y, out, 1, KIND); break;            \
        case 2: block_row(x, q, d, m, in, o, y, out, 2, KIND); break;            \
        case 3: block_row(x, q, d, m, in, o, y, out, 3, KIND); break;            \
        case 4: block_row(x, q, d, m, in, o, y, out, 4, KIND); break;            \
        case 5: block_row(x, q, d, m, in, o, y, out, 5, KIND); break;            \
        case 6: block_row(x, q, d, m, in, o, y, out, 6, KIND); break;            \
        case 7: block_row(x, q, d, m, in, o, y, out, 7, KIND); break;            \
        default: block_row(x, q, d, m, in, o, y, out, 8, KIND); break;           \
    }

/* y[r, o] = sum_i x[r, i] * W[o, i] + (bias ? bias[o] : 0) for W in blocks of `kind` (above);
 * q: [out, in / 32 * block bytes], d, m: [out, in / 32]; in a multiple of 32, rows 1 to BLOCK_MAX_ROWS. */
void gemv_blocks_f32(const float* x, const uint8_t* q, const float* d, const float* m, const float* bias, float* y,
                     int rows, int64_t in, int64_t out, int kind, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (out * in >= 65536) schedule(static)
    for (int64_t o = 0; o < out; ++o) {
        if (kind == BLOCK_Q8_0) {
            BLOCK_ROWS_CASES(BLOCK_Q8_0)
        } else {
            BLOCK_ROWS_CASES(BLOCK_Q4_1)
        }
        if (bias)
            for (int r = 0; r < rows; ++r) y[r * out + o] += bias[o];
    }
}
