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
 * With AMX (a Xeon from Sapphire Rapids on) the same layout is what a tile multiply reads for its
 * second operand: a group's 16 pairs of inputs are 16 rows of 64 bytes, one B tile. So where the
 * build has AMX and the process may use its tiles (bf16_matmul_amx()), TDPBF16PS does the work,
 * 32 rows x 2 groups at a time: beside oneDNN's AMX kernel it saves the per-call overhead at decode
 * sizes and needs no second copy of the weight, and the C decoder stack (decoder_stack.c) runs
 * on it (benchmarks/RESULTS.md, "Xeon (AMX): CPU kernels").
 *
 * Without AVX512-BF16 the weights are widened to float32 and multiplied by FMAs (AVX-512 or
 * AVX2), and without those a plain loop computes the same sums: engines use the kernel there only
 * under `deterministic`, elsewhere only where bf16_matmul_native() (kernels/cpu/bf16_matmul.py's
 * native()); tests check the layout and the leftovers with each. Every path sums a row in one
 * order whatever the row count (`deterministic` relies on it).
 * Built at first use by kernels/cpu/native_build.py (-O3 -march=native -fopenmp).
 */
#define _GNU_SOURCE /* syscall() */
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
int bf16_matmul_widened(void) { return 0; }

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
#elif defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

int bf16_matmul_native(void) { return 0; }
int bf16_matmul_widened(void) { return 1; }

/* Without AVX512-BF16, for `deterministic` (backend/cpu/linear_methods.py packs bf16 layers in
 * pairs there whatever the CPU, for a row's one order of sums): each pair's weights widened to
 * float32 (the low halves shifted up, the high halves masked) and multiplied by FMAs, input by
 * input, so a row's sums run in input order at any row count. VEC outputs a vector; a group is
 * 16 / VEC vectors; RB rows a block keep the accumulators in registers. */
#if defined(__AVX512F__)
#include "cpu_avx512.h"
#define VEC 16
#define RB 8
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vbroadcast(uint32_t bits) { return _mm512_castsi512_ps(_mm512_set1_epi32((int)bits)); }
static inline void vpair(const uint32_t* w, vec* low, vec* high) {
    const __m512i v = _mm512_loadu_si512(w);
    *low = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *high = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void vstore(uint16_t* y, vec s, const float* bias) {
    store16(y, 0, bias ? _mm512_add_ps(s, _mm512_loadu_ps(bias)) : s, 0xffff, DTYPE_BF16);
}
#else
#include "cpu_avx2.h"
#define VEC 8
#define RB 4
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vbroadcast(uint32_t bits) { return _mm256_castsi256_ps(_mm256_set1_epi32((int)bits)); }
static inline void vpair(const uint32_t* w, vec* low, vec* high) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)w);
    *low = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *high = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline void vstore(uint16_t* y, vec s, const float* bias) {
    store8(y, 0, bias ? _mm256_add_ps(s, _mm256_loadu_ps(bias)) : s, DTYPE_BF16);
}
#endif
#define PARTS (GROUP / VEC) /* vectors a group's outputs fill */

/* Up to RB rows (R, a constant) of x times one group of w. */
static inline __attribute__((always_inline)) void widened_block(const uint16_t* x, int64_t in, const uint32_t* w,
                                                                const float* bias, uint16_t* y, int64_t out,
                                                                const int R) {
    vec acc[RB][PARTS];
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < PARTS; ++h) acc[r][h] = vzero();
    const uint32_t* xp = (const uint32_t*)x;
    const int64_t pairs = in / 2;
    for (int64_t k = 0; k < pairs; ++k) {
        vec low[PARTS], high[PARTS];
        for (int h = 0; h < PARTS; ++h) vpair(w + k * GROUP + h * VEC, &low[h], &high[h]);
        for (int r = 0; r < R; ++r) {
            const uint32_t both = xp[r * pairs + k];
            const vec even = vbroadcast(both << 16), odd = vbroadcast(both & 0xffff0000u);
            for (int h = 0; h < PARTS; ++h) acc[r][h] = vfma(odd, high[h], vfma(even, low[h], acc[r][h]));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < PARTS; ++h) vstore(y + r * out + h * VEC, acc[r][h], bias ? bias + h * VEC : 0);
}

static inline void tile(const uint16_t* x, int64_t in, const uint32_t* w, int64_t gstride, const float* bias,
                        uint16_t* y, int64_t out, const int ROWS, const int NV, Ahead ahead) {
    (void)ahead;
    for (int v = 0; v < NV; ++v)
        for (int r = 0; r < ROWS; r += RB) {
            const uint16_t* xs = x + r * in;
            const uint32_t* ws = w + v * gstride;
            const float* bs = bias ? bias + GROUP * v : 0;
            uint16_t* ys = y + r * out + GROUP * v;
            switch (ROWS - r < RB ? ROWS - r : RB) {
#if RB == 8
                case 8: widened_block(xs, in, ws, bs, ys, out, 8); break;
                case 7: widened_block(xs, in, ws, bs, ys, out, 7); break;
                case 6: widened_block(xs, in, ws, bs, ys, out, 6); break;
                case 5: widened_block(xs, in, ws, bs, ys, out, 5); break;
#endif
                case 4: widened_block(xs, in, ws, bs, ys, out, 4); break;
                case 3: widened_block(xs, in, ws, bs, ys, out, 3); break;
                case 2: widened_block(xs, in, ws, bs, ys, out, 2); break;
                default: widened_block(xs, in, ws, bs, ys, out, 1); break;
            }
        }
}
#else
int bf16_matmul_native(void) { return 0; }
int bf16_matmul_widened(void) { return 0; }

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 32      /* rows a block covers: two A tiles of 16 */
#define AMX_CHUNK 256    /* rows per pass over the weights: each core reads a panel once per pass */
#define STREAM_BYTES (1 << 20) /* outputs larger than this bypass the cache (an LM head's logits) */

static int amx_state; /* 0: not asked, 1: the kernel may use tiles, -1: it may not */

/* Linux hands a process AMX's 8 KB tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM
 * for XFEATURE_XTILEDATA); asked once, for every thread of the process. 1 where granted. */
int bf16_matmul_amx(void) {
    if (!amx_state) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 ? 1 : -1;
    return amx_state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0, 1: rows 0-15 and 16-31 of x (A); 2, 3: two groups' weights (B); 4-7: the four sums
 * (C) of A i x B j at 4 + 2 i + j. A and C tiles hold `m` rows in all (the last block's fewer
 * rows: a tile of more would read past x). */
static void configure_tiles(int m) {
    TileConfig c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int m0 = m > 16 ? 16 : m, m1 = m - m0;
    c.rows[2] = c.rows[3] = 16;
    c.rows[0] = c.rows[4] = c.rows[5] = m0;
    c.rows[1] = c.rows[6] = c.rows[7] = m1;
    for (int t = 0; t < 8; ++t) c.colsb[t] = c.rows[t] ? 64 : 0;
    __asm__ volatile("ldtilecfg %0" : : "m"(c)); /* not _tile_loadconfig: gcc 12 dropped stores to c before it */
}

/* m (<= 32) rows of x times one or two groups of w: TWO_A whether m > 16, TWO_B two groups. */
static inline __attribute__((always_inline)) void amx_block(const uint16_t* x, int64_t in, int m, const uint32_t* w,
                                                            int64_t gstride, const float* bias, uint16_t* y,
                                                            int64_t out, int stream, const int TWO_A,
                                                            const int TWO_B) {
    _tile_zero(4);
    if (TWO_B) _tile_zero(5);
    if (TWO_A) _tile_zero(6);
    if (TWO_A && TWO_B) _tile_zero(7);
    for (int64_t k = 0; k < in / 32; ++k) { /* 16 pairs of inputs a step */
        _tile_loadd(2, w + k * 16 * GROUP, 64);
        _tile_loadd(0, x + k * 32, in * 2);
        _tile_dpbf16ps(4, 0, 2);
        if (TWO_B) {
            _tile_loadd(3, w + gstride + k * 16 * GROUP, 64);
            _tile_dpbf16ps(5, 0, 3);
        }
        if (TWO_A) {
            _tile_loadd(1, x + 16 * in + k * 32, in * 2);
            _tile_dpbf16ps(6, 1, 2);
            if (TWO_B) _tile_dpbf16ps(7, 1, 3);
        }
    }
    float c[AMX_ROWS][2 * GROUP] __attribute__((aligned(64)));
    _tile_stored(4, &c[0][0], sizeof c[0]);
    if (TWO_B) _tile_stored(5, &c[0][GROUP], sizeof c[0]);
    if (TWO_A) _tile_stored(6, &c[16][0], sizeof c[0]);
    if (TWO_A && TWO_B) _tile_stored(7, &c[16][GROUP], sizeof c[0]);
    for (int r = 0; r < m; ++r)
        for (int v = 0; v < (TWO_B ? 2 : 1); ++v) {
            __m512 s = _mm512_load_ps(&c[r][GROUP * v]);
            if (bias) s = _mm512_add_ps(s, _mm512_loadu_ps(bias + GROUP * v));
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(s);
            __m256i* to = (__m256i*)(y + r * out + GROUP * v);
            if (stream)
                _mm256_stream_si256(to, h);
            else
                _mm256_storeu_si256(to, h);
        }
}

/* bf16_matmul with tiles: `in` a multiple of 32. Threads take (pass, pair of groups) items from a
 * shared counter, pass-major, and run the pass's rows over their pair 32 at a time, so at decode
 * sizes each core streams its own part of the weight once. */
static void amx_matmul(const uint16_t* x, const uint32_t* w, const float* bias, uint16_t* y, int rows, int64_t in,
                       int64_t groups, int num_threads) {
    const int64_t out = groups * GROUP, gstride = in / 2 * GROUP;
    const int64_t panels = (groups + 1) / 2, items = (rows + AMX_CHUNK - 1) / AMX_CHUNK * panels;
    const int stream = (int64_t)rows * out * 2 > STREAM_BYTES && ((uintptr_t)y & 31) == 0;
    int64_t counter = 0;
#pragma omp parallel num_threads(num_threads) if (out * in >= 65536)
    {
        int configured = 0; /* the row count the tiles are set up for */
        for (int64_t item = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED); item < items;
             item = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED)) {
            const int64_t r0 = item / panels * AMX_CHUNK, g0 = item % panels * 2;
            const int pass_rows = rows - r0 < AMX_CHUNK ? (int)(rows - r0) : AMX_CHUNK;
            const int two = groups - g0 >= 2;
            const uint32_t* ws = w + g0 * gstride;
            const float* bs = bias ? bias + g0 * GROUP : 0;
            for (int r = 0; r < pass_rows; r += AMX_ROWS) {
                const int m = pass_rows - r < AMX_ROWS ? pass_rows - r : AMX_ROWS;
                if (m != configured) configure_tiles(configured = m);
                const uint16_t* xs = x + (r0 + r) * in;
                uint16_t* ys = y + (r0 + r) * out + g0 * GROUP;
                if (m > 16 && two)
                    amx_block(xs, in, m, ws, gstride, bs, ys, out, stream, 1, 1);
                else if (m > 16)
                    amx_block(xs, in, m, ws, gstride, bs, ys, out, stream, 1, 0);
                else if (two)
                    amx_block(xs, in, m, ws, gstride, bs, ys, out, stream, 0, 1);
                else
                    amx_block(xs, in, m, ws, gstride, bs, ys, out, stream, 0, 0);
            }
        }
        if (configured) _tile_release();
        if (stream) _mm_sfence();
    }
}
#else
int bf16_matmul_amx(void) { return 0; }
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    /* whole tile steps only (bf16_matmul.py's TILE_INPUTS); every call alike, so a row's sums never change order */
    if (amx_state > 0 && in % 32 == 0) {
        amx_matmul(x, w, bias, y, rows, in, groups, num_threads);
        return;
    }
#endif
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
