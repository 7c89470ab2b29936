/* bf16 matmuls on CPU: y = x @ W^T (+ bias), bf16 in and out, sums in float32.
 *
 * Why our own: on a CPU with AVX512-BF16 (no AMX) one VDPBF16PS does 32 bf16 products into 16
 * float32 sums, twice an FMA's work; oneDNN's bf16 kernel leaves much of that peak unused at the
 * row counts of decode steps and nears it only at prefill sizes (2-core Zen 4), and splits each
 * matmul between threads up front, so on a 2-core machine serving requests a core taken by the
 * server or the client for a moment leaves the other thread waiting. This loop comes near the
 * peak from 32 rows on (weights streamed from memory as in a decode step; from fewer rows on
 * weights in cache) and hands the work out a panel at a time: faster than oneDNN's at 1-128
 * rows, level at 2,048, over a whole model's decoder layers (benchmarks/RESULTS.md, "Zen 4: CPU
 * kernels" and "Figures behind design choices in the code").
 *
 * Layout (kernels/cpu/bf16_matmul.py's PairWeight): outputs in groups of GROUP (16), and within
 * a group, for each pair of inputs (2k, 2k + 1), the 16 outputs' two weights side by side:
 * [groups][in / 2][GROUP][2] bf16. One 64-byte load is then 16 outputs' weights at two inputs,
 * what VDPBF16PS multiplies by one row's two inputs broadcast: each lane is one output's running
 * sum, no lane sums. Outputs padded to whole groups with zero weights.
 *
 * The tile is MR (8) rows x PANEL (3) groups = 48 outputs: 24 accumulators, 3 weight loads and 8
 * broadcasts feed 24 dot products per pair of inputs. A panel's weights (in x 48 x 2 bytes, 55 KB
 * at in = 576) stay in L2 while its rows pass MR at a time; rows go MC at a time so those stay
 * in cache as the panels go by. Threads take panels one at a time from a shared counter, each
 * claiming its next panel as it starts one, so that while its later row tiles run from L2 it
 * can pull the next panel's weights from memory into L2 (`Ahead`): otherwise a panel's first
 * tile waits on memory with the arithmetic idle (decode-step weights do not fit in any cache).
 * That sped up every decoder linear plus the LM head at 16, 32 and 64 rows in every run (2-core
 * Zen 4; benchmarks/RESULTS.md, "Zen 4: CPU kernels" and "Figures behind design choices in the
 * code").
 *
 * Without AVX512-BF16 a plain loop over the same layout computes the same sums (in another
 * order): tests check the layout and the leftovers with it on any CPU; engines use this kernel
 * only where bf16_matmul_native() and the CPU has no AMX (kernels/cpu/bf16_matmul.py's native()).
 * Built at first use by kernels/cpu/native_build.py (-O3 -march=native -fopenmp).
 */
#include <stdint.h>

#include "cpu_dtypes.h"

#define GROUP 16 /* kernels/cpu/bf16_matmul.py's GROUP */
#define PANEL 3  /* groups a tile covers */
#define MR 8     /* rows a tile covers */
#define MC 128   /* rows per pass over the weights */

/* Weights a tile pulls into L2 as it runs: `groups` groups from w (of the thread's next panel). */
typedef struct {
    const uint32_t* w;
    int groups;
} Ahead;

/* Full tile i of `tiles` over a panel pulls its share of the next panel: none for the first (it
 * waits on memory for its own weights), the rest split evenly among the others. The last few
 * rows' tile (i == tiles) pulls none: too short to hide the loads (9 rows ran slower when it
 * did: benchmarks/RESULTS.md, "Figures behind design choices in the code"). */
static inline Ahead ahead_share(Ahead next, int64_t gstride, int i, int tiles) {
    Ahead share = {next.w, 0};
    if (!next.w || i == 0 || i >= tiles) return share;
    const int from = (i - 1) * next.groups / (tiles - 1), to = i * next.groups / (tiles - 1);
    share.w = next.w + from * gstride;
    share.groups = to - from;
    return share;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int bf16_matmul_native(void) { return 1; }

/* ROWS rows of x (row stride `in`) times NV groups of w (group stride gstride pairs x GROUP),
 * rounded to bf16 into y (row stride `out`). ROWS and NV constants at each call. */
static inline __attribute__((always_inline)) void tile(const uint16_t* x, int64_t in, const uint32_t* w,
                                                       int64_t gstride, const float* bias, uint16_t* y, int64_t out,
                                                       const int ROWS, const int NV, Ahead ahead) {
    __m512 acc[MR][PANEL];
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    const uint32_t* xp = (const uint32_t*)x; /* a row's inputs 2k, 2k + 1 as one 32-bit value */
    const int64_t pairs = in / 2;
    for (int64_t k = 0; k < pairs; ++k) {
        __m512bh b[PANEL];
        for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(w + v * gstride + k * GROUP);
        for (int v = 0; v < ahead.groups; ++v)
            _mm_prefetch((const char*)(ahead.w + v * gstride + k * GROUP), _MM_HINT_T1);
        for (int r = 0; r < ROWS; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[r * pairs + k]);
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v) {
            __m512 s = acc[r][v];
            if (bias) s = _mm512_add_ps(s, _mm512_loadu_ps(bias + GROUP * v));
            _mm256_storeu_si256((__m256i*)(y + r * out + GROUP * v), (__m256i)_mm512_cvtneps_pbh(s));
        }
}
#else
int bf16_matmul_native(void) { return 0; }

static inline void tile(const uint16_t* x, int64_t in, const uint32_t* w, int64_t gstride, const float* bias,
                        uint16_t* y, int64_t out, const int ROWS, const int NV, Ahead ahead) {
    (void)ahead;
    const uint16_t* wh = (const uint16_t*)w; /* [pairs][GROUP][2] per group */
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v)
            for (int n = 0; n < GROUP; ++n) {
                float s = 0.0f;
                for (int64_t k = 0; k < in; ++k)
                    s += bf16_to_f32(x[r * in + k]) * bf16_to_f32(wh[2 * (v * gstride + (k / 2) * GROUP + n) + k % 2]);
                if (bias) s += bias[GROUP * v + n];
                y[r * out + GROUP * v + n] = f32_to_bf16(s);
            }
}
#endif

/* Every row of x times one panel of NV groups (a constant), pulling `next` into L2 meanwhile. */
static inline __attribute__((always_inline)) void panel_rows(const uint16_t* x, int64_t in, int rows,
                                                             const uint32_t* w, int64_t gstride, const float* bias,
                                                             uint16_t* y, int64_t out, const int NV, Ahead next) {
    const int tiles = rows / MR;
    int r = 0, i = 0;
    for (; r + MR <= rows; r += MR, ++i)
        tile(x + r * in, in, w, gstride, bias, y + r * out, out, MR, NV, ahead_share(next, gstride, i, tiles));
    const Ahead ahead = ahead_share(next, gstride, i, tiles);
    x += r * in, y += r * out;
    switch (rows - r) { /* the last few rows: one tile of their number */
        case 0: break;
        case 7: tile(x, in, w, gstride, bias, y, out, 7, NV, ahead); break;
        case 6: tile(x, in, w, gstride, bias, y, out, 6, NV, ahead); break;
        case 5: tile(x, in, w, gstride, bias, y, out, 5, NV, ahead); break;
        case 4: tile(x, in, w, gstride, bias, y, out, 4, NV, ahead); break;
        case 3: tile(x, in, w, gstride, bias, y, out, 3, NV, ahead); break;
        case 2: tile(x, in, w, gstride, bias, y, out, 2, NV, ahead); break;
        default: tile(x, in, w, gstride, bias, y, out, 1, NV, ahead); break;
    }
}

/* y[r, o] = sum_i x[r, i] * W[o, i] (+ bias[o]): x [rows, in] and y [rows, groups * GROUP]
 * contiguous bf16; w the pairs above, [groups, in / 2, GROUP] 32-bit values; bias float32
 * [groups * GROUP] or NULL; `in` even. */
void bf16_matmul(const uint16_t* x, const uint32_t* w, const float* bias, uint16_t* y, int rows, int64_t in,
                 int64_t groups, int num_threads) {
    const int64_t out = groups * GROUP, gstride = in / 2 * GROUP;
    const int64_t panels = (groups + PANEL - 1) / PANEL;
    const int64_t items = (rows + MC - 1) / MC * panels; /* (pass, panel) pairs, pass-major */
    int64_t counter = 0;
#pragma omp parallel num_threads(num_threads) if (out * in >= 65536)
    {
        int64_t item = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
        while (item < items) {
            const int64_t next = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
            const int64_t r0 = item / panels * MC, g0 = item % panels * PANEL;
            const int pass_rows = rows - r0 < MC ? (int)(rows - r0) : MC;
            const int ng = groups - g0 < PANEL ? (int)(groups - g0) : PANEL;
            Ahead ahead = {0, 0};
            if (next < items) {
                const int64_t g1 = next % panels * PANEL;
                ahead.w = w + g1 * gstride;
                ahead.groups = groups - g1 < PANEL ? (int)(groups - g1) : PANEL;
            }
            const uint16_t* xs = x + r0 * in;
            const uint32_t* ws = w + g0 * gstride;
            const float* bs = bias ? bias + g0 * GROUP : 0;
            uint16_t* ys = y + r0 * out + g0 * GROUP;
            if (ng == 3)
                panel_rows(xs, in, pass_rows, ws, gstride, bs, ys, out, 3, ahead);
            else if (ng == 2)
                panel_rows(xs, in, pass_rows, ws, gstride, bs, ys, out, 2, ahead);
            else
                panel_rows(xs, in, pass_rows, ws, gstride, bs, ys, out, 1, ahead);
            item = next;
        }
    }
}
