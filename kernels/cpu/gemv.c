/* Matrix-vector products on CPU for float32 weights: y = x @ W^T (+ bias) for a few rows of x.
 *
 * Why: one decoding sequence multiplies one row by every weight of the model, so its step
 * is bound by how fast the weights stream from memory. On a 2-core AVX2 AMD EPYC, oneDNN's
 * packed float32 matmul and MKL read them more slowly at one row than this loop over the
 * weight as the checkpoint stores it ([out, in], each output a dot product of contiguous
 * memory), and a plain sum reads them faster still (benchmarks/RESULTS.md, "Figures behind
 * design choices in the code").
 * Four weight rows go at a time, with two accumulators each to hide the FMA latency; the
 * few input rows of a call reuse those weight rows while they are in L1, so a call of up
 * to GEMV_MAX_ROWS (kernels/cpu/gemv.py) rows streams W once.
 * Built at first use by kernels/cpu/native_build.py (-O3 -march=native -fopenmp); threads split
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
#include "cpu_avx2.h"

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
