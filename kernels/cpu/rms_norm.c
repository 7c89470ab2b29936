/* RMSNorm on CPU in one pass per row.
 *
 * Why: in eager torch it is a chain of eight small ops (float, pow, mean, add, rsqrt, mul,
 * to, mul), each with its own dispatch and its own pass over memory; two per layer, each
 * after a residual add, which `add_rms_norm` does in the same pass.
 * Rounding follows transformers' order: fp32 math, the normalised row rounded to the model
 * dtype, then times the weight (rounded again); only the summation order of the row's mean
 * of squares may differ from torch's.
 * Built at first use by kernels/cpu/native_build.py; kernels/cpu/rms_norm.py calls it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_dtypes.h"


/* out = weight * round(x * scale), one row. */
static inline __attribute__((always_inline)) void rms_norm_scaled(
    const void* x, const void* weight, void* out, int64_t at, int hidden, float scale, const int dtype) {
#pragma omp simd
    for (int i = 0; i < hidden; ++i) {
        float normed = round_to(load_f32(x, at + i, dtype) * scale, dtype);
        store_f32(out, at + i, load_f32(weight, i, dtype) * normed, dtype);
    }
}

/* One row of RMSNorm: out = weight * round(x * rsqrt(mean(x^2) + eps)). dtype is a constant
 * at each call (below), so the loops vectorise for it. */
static inline __attribute__((always_inline)) void rms_norm_row(
    const void* x, const void* weight, void* out, int64_t at, int hidden, float eps, const int dtype) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < hidden; ++i) {
        float v = load_f32(x, at + i, dtype);
        sum += v * v;
    }
    rms_norm_scaled(x, weight, out, at, hidden, 1.f / sqrtf(sum / (float)hidden + eps), dtype);
}

/* One row of the residual add, then RMSNorm of the sum: h_out = round(h + delta), out as above
 * from h_out (transformers adds the residual in the model dtype, then norms the sum). */
static inline __attribute__((always_inline)) void add_rms_norm_row(
    const void* h, const void* delta, void* h_out, const void* weight, void* out, int64_t at, int hidden, float eps,
    const int dtype) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < hidden; ++i) {
        float v = round_to(load_f32(h, at + i, dtype) + load_f32(delta, at + i, dtype), dtype);
        store_f32(h_out, at + i, v, dtype);
        sum += v * v;
    }
    rms_norm_scaled(h_out, weight, out, at, hidden, 1.f / sqrtf(sum / (float)hidden + eps), dtype);
}

/* Row functions per dtype, kept out of the OpenMP-outlined loops below so that each is
 * compiled (and vectorised) with its dtype known. */
static __attribute__((noinline)) void rms_norm_row_bf16(const void* x, const void* w, void* out, int64_t at, int hidden, float eps) {
    rms_norm_row(x, w, out, at, hidden, eps, DTYPE_BF16);
}
static __attribute__((noinline)) void rms_norm_row_f32(const void* x, const void* w, void* out, int64_t at, int hidden, float eps) {
    rms_norm_row(x, w, out, at, hidden, eps, DTYPE_F32);
}
static __attribute__((noinline)) void add_rms_norm_row_bf16(const void* h, const void* d, void* h_out, const void* w,
                                                            void* out, int64_t at, int hidden, float eps) {
    add_rms_norm_row(h, d, h_out, w, out, at, hidden, eps, DTYPE_BF16);
}
static __attribute__((noinline)) void add_rms_norm_row_f32(const void* h, const void* d, void* h_out, const void* w,
                                                           void* out, int64_t at, int hidden, float eps) {
    add_rms_norm_row(h, d, h_out, w, out, at, hidden, eps, DTYPE_F32);
}

/* Rows of `hidden` values. */
void rms_norm(const void* x, const void* weight, void* out, int rows, int hidden, float eps, int dtype,
              int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * hidden >= 65536) schedule(static)
    for (int r = 0; r < rows; ++r) {
        if (dtype == DTYPE_BF16)
            rms_norm_row_bf16(x, weight, out, (int64_t)r * hidden, hidden, eps);
        else
            rms_norm_row_f32(x, weight, out, (int64_t)r * hidden, hidden, eps);
    }
}

/* h_out = h + delta, out = RMSNorm(h_out): the residual add before each norm, in the same pass. */
void add_rms_norm(const void* h, const void* delta, void* h_out, const void* weight, void* out, int rows, int hidden,
                  float eps, int dtype, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * hidden >= 65536) schedule(static)
    for (int r = 0; r < rows; ++r) {
        if (dtype == DTYPE_BF16)
            add_rms_norm_row_bf16(h, delta, h_out, weight, out, (int64_t)r * hidden, hidden, eps);
        else
            add_rms_norm_row_f32(h, delta, h_out, weight, out, (int64_t)r * hidden, hidden, eps);
    }
}
