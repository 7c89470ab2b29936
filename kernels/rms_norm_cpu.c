/* RMSNorm on CPU in one pass per row.
 *
 * Why: in eager torch it is a chain of eight small ops (float, pow, mean, add, rsqrt, mul,
 * to, mul), each with its own dispatch and its own pass over memory; two per layer.
 * Rounding follows transformers' order: fp32 math, the normalised row rounded to the model
 * dtype, then times the weight (rounded again); only the summation order of the row's mean
 * of squares may differ from torch's.
 * Built at first use by kernels/native_build.py; kernels/rms_norm_cpu.py calls it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_dtypes.h"


static inline float load(const void* base, int64_t i, int dtype) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

/* The value as the model dtype would hold it (bf16: rounded; fp32: itself). */
static inline float round_to(float v, int dtype) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

static inline void store(void* base, int64_t i, float v, int dtype) {
    if (dtype == DTYPE_BF16)
        ((uint16_t*)base)[i] = f32_to_bf16(v);
    else
        ((float*)base)[i] = v;
}

/* One row of RMSNorm: out = weight * round(x * rsqrt(mean(x^2) + eps)). dtype is a constant
 * at each call (below), so the loops vectorise for it. */
static inline __attribute__((always_inline)) void rms_norm_row(
    const void* x, const void* weight, void* out, int64_t at, int hidden, float eps, const int dtype) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < hidden; ++i) {
        float v = load(x, at + i, dtype);
        sum += v * v;
    }
    float scale = 1.f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
    for (int i = 0; i < hidden; ++i) {
        float normed = round_to(load(x, at + i, dtype) * scale, dtype);
        store(out, at + i, load(weight, i, dtype) * normed, dtype);
    }
}

/* Row functions per dtype, kept out of the OpenMP-outlined loops below so that each is
 * compiled (and vectorised) with its dtype known. */
static __attribute__((noinline)) void rms_norm_row_bf16(const void* x, const void* w, void* out, int64_t at, int hidden, float eps) {
    rms_norm_row(x, w, out, at, hidden, eps, DTYPE_BF16);
}
static __attribute__((noinline)) void rms_norm_row_f32(const void* x, const void* w, void* out, int64_t at, int hidden, float eps) {
    rms_norm_row(x, w, out, at, hidden, eps, DTYPE_F32);
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
