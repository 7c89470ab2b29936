/* AVX2 helpers the CPU kernels in C share (included where __AVX2__ and __FMA__ are defined). */
#ifndef PAGEDSERVE_CPU_AVX2_H
#define PAGEDSERVE_CPU_AVX2_H

#include <immintrin.h>
#include <stdint.h>

#include "cpu_dtypes.h"

/* The sum of the eight lanes. */
static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* The largest of the eight lanes. */
static inline float horizontal_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* Lanes i < remaining (of eight) as an all-ones/zero mask per lane (none where remaining <= 0). */
static inline __m256i lanes_below(int remaining) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(remaining), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* exp(x) for x in [-87, 88] (clamped there), as exp_clamped in cpu_avx512.h: 2^n by the
 * exponent bits (n in [-126, 127], a normal float), 2^f by the same degree-6 polynomial. */
static inline __m256 exp_clamped8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_mul_ps(_mm256_sub_ps(y, n), _mm256_set1_ps(0.693147180559945309f));
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

/* exp(x) for x <= 0 (scores minus their maximum). */
static inline __m256 exp_nonpositive8(__m256 x) { return exp_clamped8(x); }

static inline __m256 widen_bf16_8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* Eight elements from base[index..], float32 or bfloat16 (widened exactly) as dtype says. */
static inline __m256 load8(const void* base, int64_t index, int dtype) {
    return dtype == DTYPE_BF16 ? widen_bf16_8((const uint16_t*)base + index) : _mm256_loadu_ps((const float*)base + index);
}

/* Eight elements to base[index..], as float32 or rounded to the nearest bfloat16 (ties to even;
 * values are finite here). */
static inline void store8(void* base, int64_t index, __m256 values, int dtype) {
    if (dtype != DTYPE_BF16) {
        _mm256_storeu_ps((float*)base + index, values);
        return;
    }
    const __m256i bits = _mm256_castps_si256(values);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    /* packus works within 128-bit halves: lanes 0-3 land in qword 0, 4-7 in qword 2 */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128((__m128i*)((uint16_t*)base + index), _mm256_castsi256_si128(packed));
}

#endif
