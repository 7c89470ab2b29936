/* float32 matmuls on CPU for a weight stored as a GGUF checkpoint stores it: y = x @ W^T (+ bias).
 *
 * W comes in blocks of 32 inputs of a row, each d * q + m with d and m fp16 values: Q4_1 (q 4-bit,
 * 16 bytes a block: byte j holds input j in its low nibble and j + 16 in its high one) or Q8_0
 * (q int8, 32 bytes, m 0). d * q is exact in float32 (an 11-bit d times a 4- or 8-bit q), so
 * fma(d, q, m) rounds once, as the float32 weight it was read from did: the weights are bit for
 * bit the float32 ones, in a sixth (Q4_1) or a third (Q8_0) of the bytes, and only the order of
 * the sums differs from torch's (tests/kernels/test_block_matmul_cpu.py bounds it).
 *
 * Layout (kernels/cpu/block_matmul.py's BlockWeight): the blocks of GROUP (16) consecutive
 * outputs are interleaved, so that the bytes of one input position for all 16 outputs lie
 * together: expanding them gives a vector of 16 outputs' weights at one input, what an
 * outer-product loop multiplies by one broadcast input value. No lane sums: each lane is one
 * output's running sum.
 *
 * Two loops, by row count:
 * - up to GEMV_UP_TO rows (a few decoding sequences): each group's blocks are expanded in
 *   registers and multiplied by every row at once, so the weights stream from memory once;
 *   bound by memory, a sixth of the bytes is what makes it fast.
 * - more rows: bound by arithmetic. A panel of PANEL_GROUPS groups is expanded once into a
 *   scratch in L1 (input-major, KC inputs at a time), then MR rows at a time are multiplied by
 *   it: per input, the panel's vectors are loaded once and each row's value is broadcast into
 *   MR x (vectors) accumulators that never leave their registers. With AVX-512 the tile is 8
 *   rows x 48 outputs (24 of 32 registers; 3 loads and 8 broadcasts feed 24 FMAs): near a
 *   2-core Xeon's FMA peak from 32 rows, well above the lane-sum tile it replaced
 *   (benchmarks/RESULTS.md, "Figures behind design choices in the code").
 *   AVX2: 6 rows x 16 outputs (12 of 16 registers). Rows go MC at a time (fewer for long
 *   inputs), so the rows being multiplied stay in L2 while the weights pass.
 * Built at first use by kernels/cpu/native_build.py (-O3 -march=native -fopenmp); threads split the
 * outputs.
 */
#include <stdint.h>

#define GROUP 16   /* outputs interleaved in the layout: kernels/cpu/block_matmul.py's GROUP */
#define GEMV_ROWS 8 /* kernels/cpu/block_matmul.py's GEMV_ROWS */
#define MC 128      /* most rows the GEMM multiplies per pass over the weights */
#define L2_ROWS_BYTES (288 * 1024) /* most bytes of x a pass takes: fewer rows than MC for long inputs */
#define GEMV_UP_TO GEMV_ROWS /* the few-row loop wins up to 8 rows (2-core Xeon, AVX-512 and AVX2 code) */
enum { BLOCK_Q4_1 = 0, BLOCK_Q8_0 = 1 }; /* kernels/cpu/block_matmul.py's BLOCK_KINDS */

/* Bytes of one block position (32 inputs) of a group: 16 outputs x 16 (Q4_1) or 32 (Q8_0). */
static inline int64_t group_block_bytes(int kind) { return kind == BLOCK_Q8_0 ? 32 * GROUP : 16 * GROUP; }

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vec;
#define VLANES 16
#define PANEL_GROUPS 3 /* 48 outputs: 3 vectors */
#define MR 8           /* 8 x 3 accumulators */
#define KC 160         /* inputs of the scratch: 160 x 48 floats, 30 KB of L1 */
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vset1(float v) { return _mm512_set1_ps(v); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
/* 16 bytes (one input position of a group's 16 outputs) as int8 (Q8_0) or as the low and high
 * nibbles (Q4_1: inputs j and j + 16), converted to float. */
static inline void unpack_q8(const uint8_t* p, vec q[1]) {
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline void unpack_q4(const uint8_t* p, vec low[1], vec high[1]) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    low[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    high[0] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vec;
#define VLANES 8
#define PANEL_GROUPS 1 /* 16 outputs: 2 vectors */
#define MR 6           /* 6 x 2 accumulators */
#define KC 256         /* 256 x 16 floats: 16 KB of L1 */
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vset1(float v) { return _mm256_set1_ps(v); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline void unpack_q8(const uint8_t* p, vec q[2]) {
    const __m128i a = _mm_loadu_si128((const __m128i*)p);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
static inline void unpack_q4(const uint8_t* p, vec low[2], vec high[2]) {
    const __m128i a = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(a, mask), hi = _mm_and_si128(_mm_srli_epi16(a, 4), mask);
    low[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    low[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    high[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    high[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
#else
/* Without AVX2 and FMA: one-lane "vectors", which the compiler vectorises as it can. */
#include <math.h>
typedef float vec;
#define VLANES 1
#define PANEL_GROUPS 1
#define MR 2
#define KC 256
static inline vec vzero(void) { return 0.f; }
static inline vec vload(const float* p) { return *p; }
static inline void vstore(float* p, vec v) { *p = v; }
static inline vec vset1(float v) { return v; }
static inline vec vadd(vec a, vec b) { return a + b; }
static inline vec vfma(vec a, vec b, vec c) { return fmaf(a, b, c); }
static inline void unpack_q8(const uint8_t* p, vec q[GROUP]) {
    for (int n = 0; n < GROUP; ++n) q[n] = (float)(int8_t)p[n];
}
static inline void unpack_q4(const uint8_t* p, vec low[GROUP], vec high[GROUP]) {
    for (int n = 0; n < GROUP; ++n) low[n] = (float)(p[n] & 15), high[n] = (float)(p[n] >> 4);
}
#endif

#define VPG (GROUP / VLANES)          /* vectors a group's outputs fill */
#define NR (PANEL_GROUPS * GROUP)     /* outputs of a GEMM panel: the scratch's row */

/* The weights of one block position (32 inputs) of a group, input by input: each(k, w) is
 * called with the input within the block and the VPG vectors of the 16 outputs' weights. */
#define FOR_EACH_INPUT(KIND, Q, D, M, BODY)                                                               \
    do {                                                                                                  \
        vec dd_[VPG], mm_[VPG];                                                                           \
        for (int u_ = 0; u_ < VPG; ++u_) dd_[u_] = vload((D) + u_ * VLANES), mm_[u_] = vload((M) + u_ * VLANES); \
        if ((KIND) == BLOCK_Q8_0) {                                                                       \
            for (int k = 0; k < 32; ++k) {                                                                \
                vec w[VPG];                                                                               \
                unpack_q8((Q) + GROUP * k, w);                                                            \
                for (int u_ = 0; u_ < VPG; ++u_) w[u_] = vfma(dd_[u_], w[u_], mm_[u_]);                   \
                BODY                                                                                      \
            }                                                                                             \
        } else {                                                                                          \
            for (int j_ = 0; j_ < 16; ++j_) {                                                             \
                vec low_[VPG], high_[VPG];                                                                \
                unpack_q4((Q) + GROUP * j_, low_, high_);                                                 \
                {                                                                                         \
                    const int k = j_;                                                                     \
                    vec w[VPG];                                                                           \
                    for (int u_ = 0; u_ < VPG; ++u_) w[u_] = vfma(dd_[u_], low_[u_], mm_[u_]);            \
                    BODY                                                                                  \
                }                                                                                         \
                {                                                                                         \
                    const int k = j_ + 16;                                                                \
                    vec w[VPG];                                                                           \
                    for (int u_ = 0; u_ < VPG; ++u_) w[u_] = vfma(dd_[u_], high_[u_], mm_[u_]);           \
                    BODY                                                                                  \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    } while (0)

/* As FOR_EACH_INPUT, the inputs in their order (the GEMM's scratch holds them so): a Q4_1 block's
 * bytes are unpacked twice, for the low nibbles' inputs 0-15, then the high ones' 16-31. */
#define FOR_EACH_INPUT_IN_ORDER(KIND, Q, D, M, BODY)                                                      \
    do {                                                                                                  \
        if ((KIND) == BLOCK_Q8_0) {                                                                       \
            FOR_EACH_INPUT(KIND, Q, D, M, BODY);                                                          \
            break;                                                                                        \
        }                                                                                                 \
        vec dd_[VPG], mm_[VPG];                                                                           \
        for (int u_ = 0; u_ < VPG; ++u_) dd_[u_] = vload((D) + u_ * VLANES), mm_[u_] = vload((M) + u_ * VLANES); \
        for (int k = 0; k < 32; ++k) {                                                                    \
            vec low_[VPG], high_[VPG], w[VPG];                                                            \
            unpack_q4((Q) + GROUP * (k & 15), low_, high_);                                               \
            for (int u_ = 0; u_ < VPG; ++u_) w[u_] = vfma(dd_[u_], k < 16 ? low_[u_] : high_[u_], mm_[u_]); \
            BODY                                                                                          \
        }                                                                                                 \
    } while (0)

/* ---------------------------------------------------------------------- few rows */

/* y[r, 16 g .. 16 g + 15] for ROWS rows (ROWS and kind constants at each call): CHAINS running
 * sums per row and vector, so the FMAs of consecutive inputs do not wait for each other, the
 * inputs in the order their bytes hold them; or (`one_chain`) the GEMM's order: one sum from zero
 * over each `chunk_blocks` blocks of inputs, input by input, the chunks' sums added left to right. */
static inline __attribute__((always_inline)) void gemv_group(
    const float* x, int64_t in, const uint8_t* q, const float* d, const float* m, int64_t g, float* y, int64_t out,
    int64_t chunk_blocks, int one_chain, const int ROWS, const int kind) {
    enum { CHAINS = VPG == 1 ? 4 : 2, CHAIN_REGISTERS = VPG == 1 ? 8 : 4 };
    const int chains = !one_chain && ROWS * VPG * CHAINS <= CHAIN_REGISTERS ? CHAINS : 1;
    const int64_t blocks = in / 32;
    vec acc[GEMV_ROWS][CHAINS][VPG], total[GEMV_ROWS][VPG];
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < chains; ++c)
            for (int u = 0; u < VPG; ++u) acc[r][c][u] = vzero();
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = g * blocks + b;
        const float* xb = x + 32 * b;
        const uint8_t* qb = q + at * group_block_bytes(kind);
#define GEMV_INPUT                                                                                            \
    {                                                                                                         \
        for (int r = 0; r < ROWS; ++r) {                                                                      \
            const vec xv = vset1(xb[r * in + k]);                                                             \
            for (int u = 0; u < VPG; ++u) acc[r][k % chains][u] = vfma(xv, w[u], acc[r][k % chains][u]);      \
        }                                                                                                     \
    }
        if (one_chain)
            FOR_EACH_INPUT_IN_ORDER(kind, qb, d + at * GROUP, m + at * GROUP, GEMV_INPUT);
        else
            FOR_EACH_INPUT(kind, qb, d + at * GROUP, m + at * GROUP, GEMV_INPUT);
#undef GEMV_INPUT
        if ((b + 1) % chunk_blocks && b + 1 < blocks) continue;
        for (int r = 0; r < ROWS; ++r) /* a chunk's end: its sum joins the total */
            for (int u = 0; u < VPG; ++u) {
                vec sum = acc[r][0][u];
                for (int c = 1; c < chains; ++c) sum = vadd(sum, acc[r][c][u]);
                total[r][u] = b + 1 <= chunk_blocks ? sum : vadd(sum, total[r][u]);
                for (int c = 0; c < chains; ++c) acc[r][c][u] = vzero();
            }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int u = 0; u < VPG; ++u) vstore(y + r * out + GROUP * g + VLANES * u, total[r][u]);
}

#define GEMV_ROWS_CASES(KIND)                                                    \
    switch (rows) {                                                              \
        case 1: gemv_group(x, in, q, d, m, g, y, out, chunk_blocks, one_chain, 1, KIND); break;           \
        case 2: gemv_group(x, in, q, d, m, g, y, out, chunk_blocks, one_chain, 2, KIND); break;           \
        case 3: gemv_group(x, in, q, d, m, g, y, out, chunk_blocks, one_chain, 3, KIND); break;           \
        case 4: gemv_group(x, in, q, d, m, g, y, out, chunk_blocks, one_chain, 4, KIND); break;           \
        case 5: gemv_group(x, in, q, d, m, g, y, out, chunk_blocks, one_chain, 5, KIND); break;           \
        case 6: gemv_group(x, in, q, d, m, g, y, out, chunk_blocks, one_chain, 6, KIND); break;           \
        case 7: gemv_group(x, in, q, d, m, g, y, out, chunk_blocks, one_chain, 7, KIND); break;           \
        default: gemv_group(x, in, q, d, m, g, y, out, chunk_blocks, one_chain, 8, KIND); break;          \
    }

/* How many inputs the GEMM sums from zero before adding to its output (KC or fewer, the chunks
 * even): the few-row loop's `one_chain` sums in these chunks too. */
static int64_t chunk_inputs(int64_t in) {
    const int64_t blocks = in / 32, chunks = (in + KC - 1) / KC;
    return (blocks + chunks - 1) / chunks * 32;
}

/* y [rows, groups * GROUP] (the padded outputs): rows <= GEMV_ROWS. */
static void block_gemv(const float* x, const uint8_t* q, const float* d, const float* m, float* y, int rows,
                       int64_t in, int64_t groups, int kind, int one_chain, int num_threads) {
    const int64_t chunk_blocks = chunk_inputs(in) / 32;
    const int64_t out = groups * GROUP;
#pragma omp parallel for num_threads(num_threads) if (out * in >= 65536) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        if (kind == BLOCK_Q8_0) {
            GEMV_ROWS_CASES(BLOCK_Q8_0)
        } else {
            GEMV_ROWS_CASES(BLOCK_Q4_1)
        }
    }
}

/* ---------------------------------------------------------------------- many rows */

/* scratch[(k - k0) * NR + GROUP * j + n] = W[GROUP * (g0 + j) + n, k] for k in [k0, k0 + len), j < ng. */
static inline __attribute__((always_inline)) void expand_panel(
    const uint8_t* q, const float* d, const float* m, int64_t blocks, int64_t g0, int ng, int64_t k0, int64_t len,
    float* restrict scratch, const int kind) {
    for (int j = 0; j < ng; ++j)
        for (int64_t b = k0 / 32; b < (k0 + len) / 32; ++b) {
            const int64_t at = (g0 + j) * blocks + b;
            float* dst = scratch + (b * 32 - k0) * NR + GROUP * j;
            FOR_EACH_INPUT(kind, q + at * group_block_bytes(kind), d + at * GROUP, m + at * GROUP, {
                for (int u = 0; u < VPG; ++u) vstore(dst + k * NR + VLANES * u, w[u]);
            });
        }
}

/* ROWS rows of x (row stride xs) times NV vectors of the scratch over `len` inputs, into y (row
 * stride ys): stored, or added to y where `accumulate` (a later chunk of the inputs), plus the
 * bias where given (the last chunk). ROWS and NV constants at each call. */
static inline __attribute__((always_inline)) void tile(const float* x, int64_t xs, const float* w, int64_t len,
                                                       float* y, int64_t ys, int accumulate, const float* bias,
                                                       const int ROWS, const int NV) {
    vec acc[MR][PANEL_GROUPS * VPG];
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
    for (int64_t k = 0; k < len; ++k) {
        vec wv[PANEL_GROUPS * VPG];
        for (int v = 0; v < NV; ++v) wv[v] = vload(w + k * NR + VLANES * v);
        for (int r = 0; r < ROWS; ++r) {
            const vec xv = vset1(x[r * xs + k]);
            for (int v = 0; v < NV; ++v) acc[r][v] = vfma(xv, wv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v) {
            vec s = acc[r][v];
            if (accumulate) s = vadd(s, vload(y + r * ys + VLANES * v));
            if (bias) s = vadd(s, vload(bias + VLANES * v));
            vstore(y + r * ys + VLANES * v, s);
        }
}

/* Every row of x times one panel of NV vectors (a constant). */
static inline __attribute__((always_inline)) void panel_rows(const float* x, int64_t xs, int rows, const float* w,
                                                             int64_t len, float* y, int64_t ys, int accumulate,
                                                             const float* bias, const int NV) {
    int r = 0;
    for (; r + MR <= rows; r += MR) tile(x + r * xs, xs, w, len, y + r * ys, ys, accumulate, bias, MR, NV);
    x += r * xs, y += r * ys;
    switch (rows - r) { /* the last few rows: one tile of their number */
        case 0: break;
#if MR > 7
        case 7: tile(x, xs, w, len, y, ys, accumulate, bias, 7, NV); break;
#endif
#if MR > 6
        case 6: tile(x, xs, w, len, y, ys, accumulate, bias, 6, NV); break;
#endif
#if MR > 5
        case 5: tile(x, xs, w, len, y, ys, accumulate, bias, 5, NV); break;
#endif
#if MR > 4
        case 4: tile(x, xs, w, len, y, ys, accumulate, bias, 4, NV); break;
#endif
#if MR > 3
        case 3: tile(x, xs, w, len, y, ys, accumulate, bias, 3, NV); break;
#endif
#if MR > 2
        case 2: tile(x, xs, w, len, y, ys, accumulate, bias, 2, NV); break;
#endif
        default: tile(x, xs, w, len, y, ys, accumulate, bias, 1, NV); break;
    }
}

/* Each panel width's row loop as a function of its own, not inlined into the threads' item loop:
 * there the tile's row offsets found no free registers and were reloaded from the stack at every
 * input (slower at 128 to 2,048 rows on a 2-core AVX2 EPYC, every decoder linear, median:
 * benchmarks/RESULTS.md, "Zen 3: the float32 block GEMM at prefill sizes"; the sums unchanged). */
#define PANEL_ROWS_OF_WIDTH(NV)                                                                                    \
    static __attribute__((noinline)) void panel_rows_##NV(const float* x, int64_t xs, int rows, const float* w,   \
                                                          int64_t len, float* y, int64_t ys, int accumulate,     \
                                                          const float* bias) {                                   \
        panel_rows(x, xs, rows, w, len, y, ys, accumulate, bias, NV);                                            \
    }
PANEL_ROWS_OF_WIDTH(1)
#if PANEL_GROUPS * VPG >= 2
PANEL_ROWS_OF_WIDTH(2)
#endif
#if PANEL_GROUPS * VPG >= 3
PANEL_ROWS_OF_WIDTH(3)
#endif
#if PANEL_GROUPS * VPG == 16
PANEL_ROWS_OF_WIDTH(16)
#endif

static void panel(const float* x, int64_t in, int rows, const uint8_t* q, const float* d, const float* m,
                  const float* bias, float* y, int64_t out, int64_t g0, int ng, int64_t chunk, float* scratch, int kind) {
    const int64_t blocks = in / 32;
    for (int64_t k0 = 0; k0 < in; k0 += chunk) {
        const int64_t len = in - k0 < chunk ? in - k0 : chunk;
        if (kind == BLOCK_Q8_0)
            expand_panel(q, d, m, blocks, g0, ng, k0, len, scratch, BLOCK_Q8_0);
        else
            expand_panel(q, d, m, blocks, g0, ng, k0, len, scratch, BLOCK_Q4_1);
        const float* xs = x + k0;
        float* ys = y + GROUP * g0;
        const float* last_bias = bias && k0 + len == in ? bias + GROUP * g0 : 0;
        switch (ng * VPG) {
#if PANEL_GROUPS * VPG >= 3
            case 3: panel_rows_3(xs, in, rows, scratch, len, ys, out, k0 > 0, last_bias); break;
#endif
#if PANEL_GROUPS * VPG == 16
            case 16: panel_rows_16(xs, in, rows, scratch, len, ys, out, k0 > 0, last_bias); break;
#endif
#if PANEL_GROUPS * VPG >= 2
            case 2: panel_rows_2(xs, in, rows, scratch, len, ys, out, k0 > 0, last_bias); break;
#endif
            default: panel_rows_1(xs, in, rows, scratch, len, ys, out, k0 > 0, last_bias); break;
        }
    }
}

/* y [rows, groups * GROUP] (the padded outputs), bias padded alike. */
static void block_gemm(const float* x, const uint8_t* q, const float* d, const float* m, const float* bias, float* y,
                       int rows, int64_t in, int64_t groups, int kind, int num_threads) {
    const int64_t out = groups * GROUP, chunk = chunk_inputs(in);
    const int64_t panels = (groups + PANEL_GROUPS - 1) / PANEL_GROUPS;
    /* Rows per pass: MC, fewer for long inputs, so that a pass's rows (mc x in floats) fit in
     * L2_ROWS_BYTES and stay in L2 while every panel of the pass reads them: down_proj's 1,536
     * inputs at 128 rows (768 KB) came from L3 for each panel, which a busy neighbour on the same
     * L3 slowed down (fewer rows a pass ran faster at 512 and 2,048 rows on a 2-core AVX2 EPYC,
     * every decoder linear, median pass: benchmarks/RESULTS.md, "Figures behind design choices
     * in the code"; the sums unchanged, rows are independent). */
    int mc = (int)(L2_ROWS_BYTES / (4 * in)) / MR * MR;
    mc = mc > MC ? MC : mc < 8 * MR ? 8 * MR : mc;
    const int64_t passes = (rows + mc - 1) / mc;
#pragma omp parallel num_threads(num_threads) if (out * in >= 65536)
    {
        float scratch[KC * NR] __attribute__((aligned(64)));
        /* One item = a pass's rows times one panel, handed out one at a time, not halved up
         * front: on a 2-core machine serving requests, another process (tritonserver, the
         * client) takes a core now and then, and a static half would leave the other thread
         * waiting at the barrier. Items go pass by pass, so both threads share the pass's rows in
         * cache; one loop over every pass's items, not a loop per pass, so the threads meet at one
         * barrier per call instead of one per pass (2-core AVX2 EPYC, every decoder linear: the
         * median pass faster at 512 and 2,048 rows; the sums unchanged; benchmarks/RESULTS.md,
         * "Figures behind design choices in the code"). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < passes * panels; ++item) {
            const int r0 = (int)(item / panels) * mc;
            const int pass_rows = rows - r0 < mc ? rows - r0 : mc;
            const int64_t g0 = item % panels * PANEL_GROUPS;
            const int ng = groups - g0 < PANEL_GROUPS ? (int)(groups - g0) : PANEL_GROUPS;
            panel(x + (int64_t)r0 * in, in, pass_rows, q, d, m, bias, y + (int64_t)r0 * out, out, g0, ng, chunk,
                  scratch, kind);
        }
    }
}

/* y[r, o] = sum_i x[r, i] * W[o, i] + (bias ? bias[o] : 0) for W in blocks of `kind` (above), its
 * outputs padded to groups * GROUP: x [rows, in], y [rows, groups * GROUP] contiguous float32;
 * q: [groups, in / 32, block bytes, GROUP], d, m: [groups, in / 32, GROUP]; bias [groups * GROUP]
 * or NULL; in a multiple of 32. `batch_invariant`: a row's sums in the same order at every row
 * count (the few-row loop with one chain), else a row alone or beside one other may take several
 * chains (faster on AVX-512) and differ from more rows in the last bits. */
void block_matmul_f32(const float* x, const uint8_t* q, const float* d, const float* m, const float* bias, float* y,
                      int rows, int64_t in, int64_t groups, int kind, int batch_invariant, int num_threads) {
    if (rows <= GEMV_UP_TO) {
        block_gemv(x, q, d, m, y, rows, in, groups, kind, batch_invariant, num_threads);
        if (bias)
            for (int r = 0; r < rows; ++r)
                for (int64_t o = 0; o < groups * GROUP; ++o) y[r * groups * GROUP + o] += bias[o];
    } else {
        block_gemm(x, q, d, m, bias, y, rows, in, groups, kind, num_threads);
    }
}
