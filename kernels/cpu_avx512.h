/* AVX-512 helpers the CPU kernels in C share (included where __AVX512F__ is defined). */
#ifndef PAGEDSERVE_CPU_AVX512_H
#define PAGEDSERVE_CPU_AVX512_H

#include <immintrin.h>

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

#endif
