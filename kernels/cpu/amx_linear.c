// bf16 linears on AMX tiles, reading the weight oneDNN packed at load in place: out[M, N] =
// x[M, K] @ W^T (+ bias). Its twin is kernels/reference.py's small_linear_ref (a plain matmul
// in float32, rounded once); kernels/small_linear.py checks the layout and calls it,
// engine/model/linear.py picks it for the row counts where it pays.
//
// Why: on an AMX host oneDNN packs a bf16 weight as AB16b32a2b and the C kernel for
// AB16b64a2b (small_linear.c) cannot read it, so every decode-sized linear went through
// `torch.ops.mkldnn._linear_pointwise`, which spent ~10 us a call outside oneDNN and streamed
// the weights of a decode step at 12-17 GB/s where the host reads 24 GB/s
// (benchmarks/reports/2026-12-06-xeon-amx-linears/).
//
// The layout, AB16b32a2b = [N / 32][K / 2][32 columns][2] (k in pairs), is what a tile load
// takes as it is: one 32-column block's 32 k (16 pairs) are 16 rows of 128 bytes, two B tiles
// of 16 columns a row apart by 64 bytes. Each thread takes a run of column blocks;
// rows go in groups of 32 (two A tiles, four accumulators) under each block, so a block's
// weight is read from memory once whatever M is. Sums are float32 in the tile unit and are
// rounded once (to nearest even) to bf16, as oneDNN's bf16 matmul does.

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "amx_pass.h"
#include "steal.h"
#define LANES 16
#include "simd.h"

// fp32 sums [rows][32] (+ bias) rounded to bf16 into out's rows, N apart
INLINE void store_rows(const float sums[][COLS], int rows, const uint16_t *bias, uint16_t *out,
                       int64_t N) {
    const vec bias_lo = bias ? load_bf16(bias) : (vec){0};
    const vec bias_hi = bias ? load_bf16(bias + 16) : (vec){0};
    for (int r = 0; r < rows; r++) {
        const vec lo = load_f32(sums[r]) + bias_lo, hi = load_f32(sums[r] + 16) + bias_hi;
        _mm512_storeu_si512(out + r * N, (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));
    }
}

// one column block (w: its K * 32 values) for rows [0, rows0 + rows1) of x (K apart)
INLINE void block_pass(const uint16_t *w, const uint16_t *x, int64_t K, int rows0, int rows1,
                       int prefetch, float sums[][COLS]) {
    _tile_zero(T_C00);
    _tile_zero(T_C01);
    if (rows1) {
        _tile_zero(T_C10);
        _tile_zero(T_C11);
    }
    for (int64_t k = 0; k < K; k += K_STEP, w += K_STEP * COLS) {
        if (prefetch) prefetch_step((const char *)w);
        _tile_loadd(T_B0, w, COLS * 4);
        _tile_loadd(T_B1, w + 32, COLS * 4);
        _tile_loadd(T_A0, x + k, K * 2);
        _tile_dpbf16ps(T_C00, T_A0, T_B0);
        _tile_dpbf16ps(T_C01, T_A0, T_B1);
        if (rows1) {
            _tile_loadd(T_A1, x + 16 * K + k, K * 2);
            _tile_dpbf16ps(T_C10, T_A1, T_B0);
            _tile_dpbf16ps(T_C11, T_A1, T_B1);
        }
    }
    _tile_stored(T_C00, sums[0], COLS * 4);
    _tile_stored(T_C01, sums[0] + 16, COLS * 4);
    if (rows1) {
        _tile_stored(T_C10, sums[16], COLS * 4);
        _tile_stored(T_C11, sums[16] + 16, COLS * 4);
    }
}

// one column block under rows [row0, row0 + ROW_CHUNK) of x: whole groups of 32, then the
// tail with tiles of its height (so the tiles are configured twice a block only where M has
// a tail); `configured` is the rows the thread's tiles are configured for now
static void block_rows(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                       const uint16_t *bias, uint16_t *out, int64_t block, int64_t row0,
                       int *configured, float sums[][COLS]) {
    const int64_t whole = M / GROUP * GROUP, tail = M - whole;
    const int64_t row_end = row0 + ROW_CHUNK < M ? row0 + ROW_CHUNK : M;
    const uint16_t *wb = w + block * K * COLS;
    const uint16_t *block_bias = bias ? bias + block * COLS : 0;
    for (int64_t row = row0; row < row_end; row += GROUP) {
        const int64_t rows = row < whole ? GROUP : tail;
        if (rows != *configured) configure(rows_high(rows), rows_low(rows));
        *configured = (int)rows;
        block_pass(wb, x + row * K, K, rows_high(rows), rows_low(rows), row == row0, sums);
        store_rows(sums, (int)rows, block_bias, out + row * N + block * COLS, N);
    }
}

// out [M, N] = x [M, K] @ W^T + bias; W packed as above, N a multiple of 32, K of 32; bias [N]
// or NULL. 0 on success, 1 for shapes it does not take.
//
// Each thread owns a contiguous run of column blocks and goes through it chunk of rows by
// chunk, every block under each chunk, so a prefill's x is read from L2 under each block, not
// from memory (a decode step's rows are one chunk, its weights read once): a 1,000-row
// down_proj (K 1536, x 3 MB) took 1.0 ms with the whole x under each block and 0.71 in chunks
// (2-core Xeon, 2 threads). A thread done with its run takes (chunk, block) items from the
// back of the others' (steal.h).
int amx_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                    const uint16_t *bias, uint16_t *out, int64_t num_threads) {
    if (M < 0 || K <= 0 || N <= 0 || K % K_STEP || N % COLS || num_threads < 1) return 1;
    if (M == 0) return 0;
    const int64_t blocks = N / COLS, chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
    const int64_t threads = team_size(num_threads < blocks ? num_threads : blocks);
    if (chunks * blocks >= INT32_MAX) return 1;  // items share a word in steal.h
    run runs[MAX_RUNS];
    for (int64_t t = 0; t < threads; t++)
        runs[t] = run_of(0, (uint64_t)(chunks * (blocks * (t + 1) / threads - blocks * t / threads)));
#pragma omp parallel num_threads(threads)
    {
        float sums[GROUP][COLS] __attribute__((aligned(64)));
        const int64_t me = omp_get_thread_num();
        int configured = -1;
        int64_t k = 0, item;
        while ((item = next_item(runs, threads, me, &k)) >= 0) {  // its own run, then others'
            const int64_t t = (me + k) % threads, first = blocks * t / threads;
            const int64_t run_blocks = blocks * (t + 1) / threads - first;
            block_rows(x, M, K, w, N, bias, out, first + item % run_blocks,
                       item / run_blocks * ROW_CHUNK, &configured, sums);
        }
        if (configured >= 0) _tile_release();
    }
    return 0;
}

#else  // no AMX in this build

int tiles_ready(void) { return -1; }

int amx_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                    const uint16_t *bias, uint16_t *out, int64_t num_threads) {
    return 1;
}

#endif
