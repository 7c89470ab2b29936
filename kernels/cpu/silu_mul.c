/* SiLU(gate) * up for CPU float32 or bfloat16 rows in one pass: out[r, j] = g / (1 + exp(-g)) * u with
 * g = x[r, j], u = x[r, n + j], x the fused gate_up projection's output [rows, 2n].
 *
 * Why: torch runs SiLU over the gate half (a strided view) and then the product, two passes
 * and a noticeable part of a prefill step at 2,048 rows x 1,536 (SmolLM2, 2-core Xeon;
 * benchmarks/RESULTS.md, "Figures behind design choices in the code"). The same formula here,
 * the division exact, exp by cpu_avx512.h's polynomial (relative error ~2e-7, where torch's is
 * ~1 ulp). bfloat16 rows are widened as read and the product rounded once (torch rounds SiLU's
 * output and then the product). Built at first use by
 * kernels/cpu/native_build.py (-O3 -march=native -fopenmp); AVX-512, or AVX2 and FMA (8 lanes, the
 * same polynomial, the last partial vector through a small buffer); elsewhere silu_mul_available
 * says 0, the library is not used and the caller runs torch.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include "cpu_avx512.h"

int silu_mul_available(void) { return 1; }

/* x: [rows, 2n], out: [rows, n], both float32 or both bfloat16 (dtype, cpu_dtypes.h). */
static inline __attribute__((always_inline)) void silu_mul_rows(const void* x, void* out, int64_t rows, int64_t n,
                                                                int num_threads, const int dtype) {
#pragma omp parallel for num_threads(num_threads) if (rows * n >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t gate = r * 2 * n, up = gate + n;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
            const __m512 g = load16(x, gate + j, k, dtype), u = load16(x, up + j, k, dtype);
            const __m512 e = exp_clamped(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
            store16(out, r * n + j, _mm512_mul_ps(s, u), k, dtype);
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include "cpu_avx2.h"

int silu_mul_available(void) { return 1; }

static inline __m256 silu_times8(__m256 g, __m256 u) {
    const __m256 e = exp_clamped8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

static inline __attribute__((always_inline)) void silu_mul_rows(const void* x, void* out, int64_t rows, int64_t n,
                                                                int num_threads, const int dtype) {
#pragma omp parallel for num_threads(num_threads) if (rows * n >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t gate = r * 2 * n, up = gate + n;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8)
            store8(out, r * n + j, silu_times8(load8(x, gate + j, dtype), load8(x, up + j, dtype)), dtype);
        if (j < n) { /* the last partial vector, through buffers of eight (zeros past the row) */
            float g[8] = {0}, u[8] = {0}, y[8];
            for (int64_t i = j; i < n; ++i) g[i - j] = load_f32(x, gate + i, dtype), u[i - j] = load_f32(x, up + i, dtype);
            _mm256_storeu_ps(y, silu_times8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
            for (int64_t i = j; i < n; ++i) store_f32(out, r * n + i, y[i - j], dtype);
        }
    }
}
#else
int silu_mul_available(void) { return 0; }
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
void silu_mul(const void* x, void* out, int64_t rows, int64_t n, int num_threads, int dtype) {
    if (dtype == DTYPE_BF16)
        silu_mul_rows(x, out, rows, n, num_threads, DTYPE_BF16);
    else
        silu_mul_rows(x, out, rows, n, num_threads, DTYPE_F32);
}
#endif
