/* AVX-512 helpers the CPU kernels in C share (included where __AVX512F__ is defined). */
#ifndef PAGEDSERVE_CPU_AVX512_H
#define PAGEDSERVE_CPU_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "cpu_dtypes.h"

/* exp(x) for x in [-87, 88] (clamped there): 2^(x log2 e) split into an integer power (scalef)
 * and 2^f, f in [-0.5, 0.5], by a degree-6 polynomial; relative error ~2e-7. */
static inline __m512 exp_clamped(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* exp(x) for x <= 0 (scores minus their maximum). */
static inline __m512 exp_nonpositive(__m512 x) { return exp_clamped(x); }

/* The lanes of k from base[at..], float32 or bfloat16 (widened exactly) as dtype says; others 0. */
static inline __m512 load16(const void* base, int64_t at, __mmask16 k, const int dtype) {
    if (dtype != DTYPE_BF16) return _mm512_maskz_loadu_ps(k, (const float*)base + at);
    const __m256i half = _mm256_maskz_loadu_epi16(k, (const uint16_t*)base + at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* The lanes of k to base[at..], as float32 or rounded to the nearest bfloat16 (ties to even;
 * values are finite here). */
static inline void store16(void* base, int64_t at, __m512 values, __mmask16 k, const int dtype) {
    if (dtype != DTYPE_BF16) {
        _mm512_mask_storeu_ps((float*)base + at, k, values);
        return;
    }
    const __m512i bits = _mm512_castps_si512(values);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_mask_storeu_epi16((uint16_t*)base + at, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

#endif
