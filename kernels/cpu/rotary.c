/* Rotary position embedding on CPU: q and k heads of every token in one pass.
 *
 * Why: in eager torch it is seven small ops per layer (two products, two slices, a negation,
 * a concatenation, a sum), each with its own dispatch and allocation.
 * Rounding follows transformers' order, in the model dtype: x*cos and rotate_half(x)*sin
 * each rounded, then their sum rounded (bf16: via fp32, as torch computes bf16 ops; fp32: no
 * fused multiply-add, which -std=c11 keeps GCC from contracting to).
 * Built at first use by kernels/cpu/native_build.py; kernels/cpu/rotary.py calls it.
 */
#include <stdint.h>

#include "cpu_dtypes.h"

/* One token: `heads` rows of head_dim at x + at (consecutive), rotated into out + out_at. */
static inline __attribute__((always_inline)) void rotate_token(
    const void* x, int64_t at, void* out, int64_t out_at, const void* cos, const void* sin, int64_t table_at,
    int heads, int head_dim, const int dtype) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; ++h) {
        const int64_t row = at + (int64_t)h * head_dim, out_row = out_at + (int64_t)h * head_dim;
#pragma omp simd
        for (int i = 0; i < half; ++i) {
            float lo = load_f32(x, row + i, dtype), hi = load_f32(x, row + half + i, dtype);
            float c_lo = load_f32(cos, table_at + i, dtype), s_lo = load_f32(sin, table_at + i, dtype);
            float c_hi = load_f32(cos, table_at + half + i, dtype), s_hi = load_f32(sin, table_at + half + i, dtype);
            /* rotate_half(x) is (-hi, lo): out_lo = lo*c - hi*s, out_hi = hi*c + lo*s */
            float a_lo = round_to(lo * c_lo, dtype), b_lo = round_to(-hi * s_lo, dtype);
            float a_hi = round_to(hi * c_hi, dtype), b_hi = round_to(lo * s_hi, dtype);
            store_f32(out, out_row + i, a_lo + b_lo, dtype);
            store_f32(out, out_row + half + i, a_hi + b_hi, dtype);
        }
    }
}

static __attribute__((noinline)) void rotate_token_bf16(const void* x, int64_t at, void* out, int64_t out_at,
                                                         const void* cos, const void* sin, int64_t table_at,
                                                         int heads, int head_dim) {
    rotate_token(x, at, out, out_at, cos, sin, table_at, heads, head_dim, DTYPE_BF16);
}
static __attribute__((noinline)) void rotate_token_f32(const void* x, int64_t at, void* out, int64_t out_at,
                                                        const void* cos, const void* sin, int64_t table_at,
                                                        int heads, int head_dim) {
    rotate_token(x, at, out, out_at, cos, sin, table_at, heads, head_dim, DTYPE_F32);
}

/* x: tokens rows of `heads` x head_dim values, row t at x + t * row_stride (elements; a view of
 * the fused projection's output); out: contiguous [tokens, heads, head_dim]; cos/sin:
 * contiguous [tokens, head_dim] in the same dtype. */
void rotary(const void* x, int64_t row_stride, void* out, const void* cos, const void* sin, int tokens, int heads,
            int head_dim, int dtype, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)tokens * heads * head_dim >= 65536) schedule(static)
    for (int t = 0; t < tokens; ++t) {
        int64_t at = (int64_t)t * row_stride, out_at = (int64_t)t * heads * head_dim, table_at = (int64_t)t * head_dim;
        if (dtype == DTYPE_BF16)
            rotate_token_bf16(x, at, out, out_at, cos, sin, table_at, heads, head_dim);
        else
            rotate_token_f32(x, at, out, out_at, cos, sin, table_at, heads, head_dim);
    }
}
