/* What the CPU kernels in C share: the dtype codes their Python callers pass, bf16
 * conversions that round as torch does, and element access by dtype (in loops where the
 * dtype is a constant, so the compiler vectorises them for it). */
#ifndef PAGEDSERVE_CPU_DTYPES_H
#define PAGEDSERVE_CPU_DTYPES_H

#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of a float32 or bfloat16 array, as fp32. */
static inline float load_f32(const void* base, int64_t i, int dtype) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

/* The value as the dtype would hold it (bf16: rounded; fp32: itself): a torch op's result. */
static inline float round_to(float v, int dtype) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

static inline void store_f32(void* base, int64_t i, float v, int dtype) {
    if (dtype == DTYPE_BF16)
        ((uint16_t*)base)[i] = f32_to_bf16(v);
    else
        ((float*)base)[i] = v;
}

#endif
