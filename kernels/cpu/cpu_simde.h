/* Tests only: the AVX-512 (and AVX512-BF16) code of the CPU kernels on a CPU without them, each
 * intrinsic emulated by SIMDe (SIMD Everywhere, header-only, portable C). kernels/cpu/native_build.py
 * force-includes this header (gcc -include) ahead of a kernel's source for the "emulated"
 * instruction sets (EMULATED there, PAGEDSERVE_CPU_MARCH=simde-avx512bf16): slow, never for serving.
 *
 * How: SIMDe is included with its native aliases (`_mm512_add_ps` becomes `simde_mm512_add_ps`),
 * which also pulls in <immintrin.h> for the CPU's own instructions (AVX2 and FMA, SIMDe's
 * fastest route). Only then are __AVX512F__ (and __AVX512BF16__) defined, so that SIMDe itself
 * does not take them for native instructions while the kernels' `#if defined(__AVX512F__)`
 * pick their AVX-512 code; the kernels' own `#include <immintrin.h>` is then a no-op.
 * The intrinsics the kernels use that this SIMDe lacks (its versions differ: Debian 12 ships
 * 0.7.4, PyPI's simde-py 0.8.2) are written below, lane by lane as Intel's pseudo-code says,
 * each only where SIMDe has no alias of that name; and the masked loads and stores, always (below). */
#ifndef PAGEDSERVE_CPU_SIMDE_H
#define PAGEDSERVE_CPU_SIMDE_H

#if defined(__AVX512F__)
#error "cpu_simde.h emulates AVX-512 where the compiler targets none: build for an older -march"
#endif

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#if defined(PAGEDSERVE_EMULATE_AVX512BF16)
#define __AVX512BF16__ 1
#endif

/* Lane access through memory (the vector types differ between SIMDe versions and targets). */
#define PS_EMU_LANES(v, f) float f[16]; memcpy(f, &(v), 64)

static inline uint16_t ps_emu_bf16_rne(float x) { /* VCVTNEPS2BF16: nearest even, NaN quietened */
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifndef _mm512_cvtne2ps_pbh
/* bf16 of b in the low 16 elements, of a in the high 16. */
static inline __m512bh ps_emu_mm512_cvtne2ps_pbh(__m512 a, __m512 b) {
    PS_EMU_LANES(a, fa);
    PS_EMU_LANES(b, fb);
    uint16_t r[32];
    for (int i = 0; i < 16; ++i) r[i] = ps_emu_bf16_rne(fb[i]), r[16 + i] = ps_emu_bf16_rne(fa[i]);
    __m512bh out;
    memcpy(&out, r, 64);
    return out;
}
#define _mm512_cvtne2ps_pbh(a, b) ps_emu_mm512_cvtne2ps_pbh(a, b)
#endif

#ifndef _mm512_cvtneps_pbh
static inline __m256bh ps_emu_mm512_cvtneps_pbh(__m512 a) {
    PS_EMU_LANES(a, fa);
    uint16_t r[16];
    for (int i = 0; i < 16; ++i) r[i] = ps_emu_bf16_rne(fa[i]);
    __m256bh out;
    memcpy(&out, r, 32);
    return out;
}
#define _mm512_cvtneps_pbh(a) ps_emu_mm512_cvtneps_pbh(a)
#endif

#ifndef _mm512_dpbf16_ps
/* src + a.lo * b.lo + a.hi * b.hi per 32-bit lane, products exact in float32 (VDPBF16PS; its
 * denormal flushing does not matter for these kernels' finite, normal values). */
static inline __m512 ps_emu_mm512_dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
    PS_EMU_LANES(src, s);
    uint16_t ha[32], hb[32];
    memcpy(ha, &a, 64);
    memcpy(hb, &b, 64);
    for (int i = 0; i < 16; ++i) {
        float x[4];
        const uint32_t bits[4] = {(uint32_t)ha[2 * i] << 16, (uint32_t)hb[2 * i] << 16, (uint32_t)ha[2 * i + 1] << 16,
                                  (uint32_t)hb[2 * i + 1] << 16};
        memcpy(x, bits, 16);
        s[i] = fmaf(x[2], x[3], fmaf(x[0], x[1], s[i]));
    }
    __m512 out;
    memcpy(&out, s, 64);
    return out;
}
#define _mm512_dpbf16_ps(src, a, b) ps_emu_mm512_dpbf16_ps(src, a, b)
#endif

#ifndef _mm512_reduce_add_ps
static inline float ps_emu_mm512_reduce_add_ps(__m512 a) {
    PS_EMU_LANES(a, f);
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += f[i];
    return s;
}
#define _mm512_reduce_add_ps(a) ps_emu_mm512_reduce_add_ps(a)
#endif

#ifndef _mm512_reduce_max_ps
static inline float ps_emu_mm512_reduce_max_ps(__m512 a) {
    PS_EMU_LANES(a, f);
    float m = f[0];
    for (int i = 1; i < 16; ++i) m = f[i] > m ? f[i] : m;
    return m;
}
#define _mm512_reduce_max_ps(a) ps_emu_mm512_reduce_max_ps(a)
#endif

#ifndef _mm512_mask_reduce_max_ps
/* The largest of the lanes of k (-inf where k has none). */
static inline float ps_emu_mm512_mask_reduce_max_ps(__mmask16 k, __m512 a) {
    PS_EMU_LANES(a, f);
    float m = -INFINITY;
    for (int i = 0; i < 16; ++i)
        if ((k >> i) & 1) m = f[i] > m ? f[i] : m;
    return m;
}
#define _mm512_mask_reduce_max_ps(k, a) ps_emu_mm512_mask_reduce_max_ps(k, a)
#endif

#ifndef _mm512_mask_reduce_min_epi32
static inline int ps_emu_mm512_mask_reduce_min_epi32(__mmask16 k, __m512i a) {
    int32_t v[16];
    memcpy(v, &a, 64);
    int32_t m = INT32_MAX;
    for (int i = 0; i < 16; ++i)
        if ((k >> i) & 1) m = v[i] < m ? v[i] : m;
    return m;
}
#define _mm512_mask_reduce_min_epi32(k, a) ps_emu_mm512_mask_reduce_min_epi32(k, a)
#endif

#ifndef _mm512_cvtepi32_epi16
/* Truncating narrowing (VPMOVDW). */
static inline __m256i ps_emu_mm512_cvtepi32_epi16(__m512i a) {
    int32_t v[16];
    int16_t r[16];
    memcpy(v, &a, 64);
    for (int i = 0; i < 16; ++i) r[i] = (int16_t)v[i];
    __m256i out;
    memcpy(&out, r, 32);
    return out;
}
#define _mm512_cvtepi32_epi16(a) ps_emu_mm512_cvtepi32_epi16(a)
#endif

#ifndef _mm512_mask_cmp_ps_mask
/* A macro: the predicate must stay a constant for SIMDe's AVX form at -O1. */
#define _mm512_mask_cmp_ps_mask(k, a, b, predicate) ((__mmask16)((k) & _mm512_cmp_ps_mask(a, b, predicate)))
#endif

#ifndef _mm512_cvtepi8_epi32
/* Sign-extending widening (VPMOVSXBD). */
static inline __m512i ps_emu_mm512_cvtepi8_epi32(__m128i a) {
    int8_t v[16];
    int32_t r[16];
    memcpy(v, &a, 16);
    for (int i = 0; i < 16; ++i) r[i] = v[i];
    __m512i out;
    memcpy(&out, r, 64);
    return out;
}
#define _mm512_cvtepi8_epi32(a) ps_emu_mm512_cvtepi8_epi32(a)
#endif

#ifndef _mm512_cvtepu8_epi32
/* Zero-extending widening (VPMOVZXBD). */
static inline __m512i ps_emu_mm512_cvtepu8_epi32(__m128i a) {
    uint8_t v[16];
    int32_t r[16];
    memcpy(v, &a, 16);
    for (int i = 0; i < 16; ++i) r[i] = v[i];
    __m512i out;
    memcpy(&out, r, 64);
    return out;
}
#define _mm512_cvtepu8_epi32(a) ps_emu_mm512_cvtepu8_epi32(a)
#endif

/* Masked loads and stores, exact: only the lanes of k are read or written. SIMDe (0.8.2) loads
 * and stores all 64 bytes (its stores write zeros to the other lanes; later versions write back
 * what they read), which overwrites memory past a row's end, another thread's included. */
static inline __m512 ps_emu_mm512_mask_loadu_ps(__m512 src, __mmask16 k, const void* p) {
    PS_EMU_LANES(src, f);
    for (int i = 0; i < 16; ++i)
        if ((k >> i) & 1) memcpy(&f[i], (const float*)p + i, 4);
    __m512 out;
    memcpy(&out, f, 64);
    return out;
}
#undef _mm512_mask_loadu_ps
#define _mm512_mask_loadu_ps(src, k, p) ps_emu_mm512_mask_loadu_ps(src, k, p)
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) ps_emu_mm512_mask_loadu_ps(_mm512_setzero_ps(), k, p)

static inline void ps_emu_mm512_mask_storeu_ps(void* p, __mmask16 k, __m512 a) {
    PS_EMU_LANES(a, f);
    for (int i = 0; i < 16; ++i)
        if ((k >> i) & 1) memcpy((float*)p + i, &f[i], 4);
}
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) ps_emu_mm512_mask_storeu_ps(p, k, a)

static inline __m256i ps_emu_mm256_maskz_loadu_epi16(__mmask16 k, const void* p) {
    uint16_t v[16] = {0};
    for (int i = 0; i < 16; ++i)
        if ((k >> i) & 1) memcpy(&v[i], (const uint16_t*)p + i, 2);
    __m256i out;
    memcpy(&out, v, 32);
    return out;
}
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16(k, p) ps_emu_mm256_maskz_loadu_epi16(k, p)

static inline void ps_emu_mm256_mask_storeu_epi16(void* p, __mmask16 k, __m256i a) {
    uint16_t v[16];
    memcpy(v, &a, 32);
    for (int i = 0; i < 16; ++i)
        if ((k >> i) & 1) memcpy((uint16_t*)p + i, &v[i], 2);
}
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16(p, k, a) ps_emu_mm256_mask_storeu_epi16(p, k, a)

#endif
