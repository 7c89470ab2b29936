/* AVX2 helpers the CPU kernels in C share (included where __AVX2__ and __FMA__ are defined). */
#ifndef PAGEDSERVE_CPU_AVX2_H
#define PAGEDSERVE_CPU_AVX2_H

#include <immintrin.h>

/* The sum of the eight lanes. */
static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

#endif
