// fp32 linears on AMX tiles: out[M, N] = x[M, K] @ W^T (+ bias), every value split into three
// bf16 parts (v = v1 + v2 + v3, each the rounding of what the parts before it left) and the
// six largest of the nine part products summed in float32 on the tile unit: cuBLAS's BF16x9
// emulation of fp32 less the three products below 2^-24 of the whole. Its twin is F.linear in
// float32; tests/kernels/test_amx_linear_f32.py holds the kernel's error against float64 to
// the twin's own.
//
// Why: a 2-core Xeon's AVX-512 FMAs ran SmolLM2's fp32 linears at 190-280 GFLOP/s, near their
// peak, where one tile product does 16x the multiply-adds of an FMA; six of them still leave the
// tile unit ahead wherever rows are many enough that the product, not reading the weight, is the
// cost (engine/model/linear_choice.py has the row counts).
//
// The weight comes as three planes (kernels/small_linear.py's split_planes), each in
// amx_linear.c's layout [N / 32][K / 2][32 columns][2]; x's rows are split here, once a call,
// into three bf16 copies [M][K] that the A tiles load as they are. A pass takes 32 rows under one
// 32-column block (amx_pass.h's layout): two A tiles (one part of x), two B tiles (one part of
// the weight) and four accumulators.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "amx_pass.h"

INLINE __m512 widen(__m256i bf16) {  // bf16 is the top half of a float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// x[i, i + 16) into its three parts: each the bf16 rounding (to nearest even) of what the
// parts before it left, a remainder that fp32 holds exactly
INLINE void split16(const float *x, uint16_t *p1, uint16_t *p2, uint16_t *p3) {
    const __m512 v = _mm512_loadu_ps(x);
    const __m256i v1 = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 r1 = _mm512_sub_ps(v, widen(v1));
    const __m256i v2 = (__m256i)_mm512_cvtneps_pbh(r1);
    const __m256i v3 = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(r1, widen(v2)));
    _mm256_storeu_si256((__m256i *)p1, v1);
    _mm256_storeu_si256((__m256i *)p2, v2);
    _mm256_storeu_si256((__m256i *)p3, v3);
}

#define LOAD_X(part)                                                \
    do {                                                            \
        _tile_loadd(T_A0, (part) + k, K * 2);                       \
        if (rows1) _tile_loadd(T_A1, (part) + 16 * K + k, K * 2);   \
    } while (0)
#define LOAD_W(part)                                  \
    do {                                              \
        _tile_loadd(T_B0, (part), COLS * 4);          \
        _tile_loadd(T_B1, (part) + 32, COLS * 4);     \
    } while (0)
#define PRODUCTS()                                    \
    do {                                              \
        _tile_dpbf16ps(T_C00, T_A0, T_B0);            \
        _tile_dpbf16ps(T_C01, T_A0, T_B1);            \
        if (rows1) {                                  \
            _tile_dpbf16ps(T_C10, T_A1, T_B0);        \
            _tile_dpbf16ps(T_C11, T_A1, T_B1);        \
        }                                             \
    } while (0)

// one column block (weight part p at w + p * plane) for a pass's rows of x's parts (K apart);
// the sums go to out (N apart) as they are, the bias after. Four accumulators, each taking one
// product of a pair of parts in turn (two accumulators taking all six each were bound by the
// products' latency, 0.85-0.9x this), in an order that loads eight pairs of tiles for the six
INLINE void block_pass(const uint16_t *w, int64_t plane, const uint16_t *x1, const uint16_t *x2,
                       const uint16_t *x3, int64_t K, int rows1, int prefetch, float *out,
                       int64_t N) {
    _tile_zero(T_C00);
    _tile_zero(T_C01);
    if (rows1) {
        _tile_zero(T_C10);
        _tile_zero(T_C11);
    }
    for (int64_t k = 0; k < K; k += K_STEP, w += K_STEP * COLS) {
        const uint16_t *w1 = w, *w2 = w + plane, *w3 = w + 2 * plane;
        if (prefetch) {
            prefetch_step((const char *)w1);
            prefetch_step((const char *)w2);
            prefetch_step((const char *)w3);
        }
        LOAD_X(x1);  // x1 w3, x1 w2, x1 w1
        LOAD_W(w3);
        PRODUCTS();
        LOAD_W(w2);
        PRODUCTS();
        LOAD_W(w1);
        PRODUCTS();
        LOAD_X(x2);  // x2 w1, x2 w2
        PRODUCTS();
        LOAD_W(w2);
        PRODUCTS();
        LOAD_X(x3);  // x3 w1
        LOAD_W(w1);
        PRODUCTS();
    }
    _tile_stored(T_C00, out, N * 4);
    _tile_stored(T_C01, out + 16, N * 4);
    if (rows1) {
        _tile_stored(T_C10, out + 16 * N, N * 4);
        _tile_stored(T_C11, out + 16 * N + 16, N * 4);
    }
}

INLINE void add_bias(const float *bias, int rows, float *out, int64_t N) {
    const __m512 lo = _mm512_loadu_ps(bias), hi = _mm512_loadu_ps(bias + 16);
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(out + r * N, _mm512_add_ps(_mm512_loadu_ps(out + r * N), lo));
        _mm512_storeu_ps(out + r * N + 16, _mm512_add_ps(_mm512_loadu_ps(out + r * N + 16), hi));
    }
}

// one thread's column blocks [first, last), every row, in chunks of ROW_CHUNK rows (as
// amx_linear.c's run_blocks); parts: x's three parts, M * K apart
static void run_blocks(const uint16_t *parts, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                       const float *bias, float *out, int64_t first, int64_t last) {
    const int64_t plane = N * K, whole = M / GROUP * GROUP;
    int configured = -1;
    for (int64_t row0 = 0; row0 < M; row0 += ROW_CHUNK) {
        const int64_t row_end = row0 + ROW_CHUNK < M ? row0 + ROW_CHUNK : M;
        for (int64_t block = first; block < last; block++) {
            const uint16_t *wb = w + block * K * COLS;
            for (int64_t row = row0; row < row_end; row += GROUP) {
                const int rows = row < whole ? GROUP : (int)(M - whole);
                if (rows != configured) configure(rows_high(rows), rows_low(rows));
                configured = rows;
                const uint16_t *x1 = parts + row * K;
                float *o = out + row * N + block * COLS;
                block_pass(wb, plane, x1, x1 + M * K, x1 + 2 * M * K, K, rows_low(rows),
                           row == row0, o, N);
                if (bias) add_bias(bias + block * COLS, rows, o, N);
            }
        }
    }
    _tile_release();
}

// out [M, N] = x [M, K] @ W^T + bias, in float32; W as three planes (above), N a multiple of 32,
// K of 32; bias [N] or NULL. 0 on success, 1 for shapes it does not take, 2 out of memory.
int amx_linear_f32(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                   const float *bias, float *out, int64_t num_threads) {
    if (M < 0 || K <= 0 || N <= 0 || K % K_STEP || N % COLS || num_threads < 1) return 1;
    if (M == 0) return 0;
    uint16_t *parts = aligned_alloc(64, (size_t)(3 * M * K * 2 + 63) / 64 * 64);
    if (!parts) return 2;
    const int64_t blocks = N / COLS;
    const int64_t threads = num_threads < blocks ? num_threads : blocks;
#pragma omp parallel num_threads(threads)
    {
        const int64_t n = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t size = M * K;  // a multiple of 32, split in runs of 16 values
        const int64_t start = size * me / n / 16 * 16;
        const int64_t end = me == n - 1 ? size : size * (me + 1) / n / 16 * 16;
        for (int64_t i = start; i < end; i += 16)
            split16(x + i, parts + i, parts + M * K + i, parts + 2 * M * K + i);
#pragma omp barrier
        run_blocks(parts, M, K, w, N, bias, out, blocks * me / n, blocks * (me + 1) / n);
    }
    free(parts);
    return 0;
}

#else  // no AMX in this build

int tiles_ready(void) { return -1; }

int amx_linear_f32(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                   const float *bias, float *out, int64_t num_threads) {
    return 1;
}

#endif
