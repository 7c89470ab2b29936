/* The first index of each row's maximum, float32 rows on CPU: greedy decoding's argmax.
 *
 * Why: torch's max(dim) over a [rows, vocab] float32 tensor ran slowly here (32 rows of a
 * 49,152-token vocabulary on a 2-core Zen 4, a share of a 32-sequence decode step worth taking
 * back; argmax is slower still; benchmarks/RESULTS.md, "Zen 4: CPU kernels" and "Figures behind
 * design choices in the code"). One AVX-512 pass per row: each lane keeps its largest value
 * and the first index it was seen at (strictly greater replaces, so ties keep the earlier
 * index), then the lanes holding the row's maximum give their smallest index. A NaN counts as
 * larger than anything, as in torch: a row holding one answers its first NaN. Built at first use by
 * kernels/cpu/native_build.py (-O3 -march=native -fopenmp); AVX-512, or AVX2 (8 lanes, the row's
 * last partial vector element by element); elsewhere first_max_available says 0 and the caller
 * runs torch.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <math.h>

int first_max_available(void) { return 1; }

static int64_t row_first_max(const float* x, int64_t n) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 best = minus_inf;
    __m512i at = _mm512_setzero_si512();
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 valid = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
        const __m512 v = _mm512_mask_loadu_ps(minus_inf, valid, x + j);
        nan |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
        const __mmask16 greater = _mm512_mask_cmp_ps_mask(valid, v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, greater, v);
        at = _mm512_mask_mov_epi32(at, greater, index);
        index = _mm512_add_epi32(index, step);
    }
    if (nan) { /* rare: find the first NaN */
        for (int64_t j = 0; j < n; ++j)
            if (isnan(x[j])) return j;
    }
    const float top = _mm512_reduce_max_ps(best);
    /* a row of -inf only: no lane replaced, every lane at index 0 */
    const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(holders, at);
}

#elif defined(__AVX2__)
#include <immintrin.h>
#include <math.h>

int first_max_available(void) { return 1; }

static int64_t row_first_max(const float* x, int64_t n) {
    const int64_t whole = n / 8 * 8;
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    __m256 at = _mm256_setzero_ps(); /* int32 indices, kept in float lanes for blendv */
    __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (int64_t j = 0; j < whole; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        best = _mm256_blendv_ps(best, v, greater);
        at = _mm256_blendv_ps(at, _mm256_castsi256_ps(index), greater);
        index = _mm256_add_epi32(index, step);
    }
    int any_nan = _mm256_movemask_ps(nan);
    for (int64_t j = whole; j < n; ++j) any_nan |= isnan(x[j]);
    if (any_nan) { /* rare: find the first NaN */
        for (int64_t j = 0; j < n; ++j)
            if (isnan(x[j])) return j;
    }
    float lane_best[8];
    int32_t lane_at[8];
    _mm256_storeu_ps(lane_best, best);
    _mm256_storeu_si256((__m256i*)lane_at, _mm256_castps_si256(at));
    float top = -INFINITY;
    int64_t first = 0; /* a row of -inf only: index 0 */
    for (int i = 0; i < 8; ++i)
        if (lane_best[i] > top || (lane_best[i] == top && lane_at[i] < first)) /* -inf lanes hold index 0 */
            top = lane_best[i], first = lane_at[i];
    for (int64_t j = whole; j < n; ++j) /* later indices: only a larger value replaces */
        if (x[j] > top) top = x[j], first = j;
    return first;
}
#else
int first_max_available(void) { return 0; }
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
/* out[r] = the first index of row r's maximum; x: [rows, n] float32 contiguous (n < 2^31). */
void first_max(const float* x, int64_t rows, int64_t n, int64_t* out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n >= 262144) schedule(static)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_first_max(x + r * n, n);
}
#endif
