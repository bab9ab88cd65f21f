// Small-row linears for AVX2 hosts (included by small_linear.c): fp32 activations against
// a weight in 64-column blocks, [N / 64][K][64 columns], either
//   - small_linear_f32 (AVX2 builds without AVX-512): oneDNN's packed fp32 weight
//     (AB16b64a), read in place; or
//   - small_linear_bf16w (every build): a bf16 weight the engine blocked the same way at load
//     (kernels/small_linear.py), on hosts where oneDNN has no native bf16 to pack it for. Each
//     k row of 16 bf16 is widened to fp32 (exact), so both compute the same float32 products.
//
// Why its own shape: a ymm holds 8 columns, so a 64-column block's row is 8 registers and the
// AVX-512 code's 6 x 64 accumulator tile would spill. Here a block is cut into strips of S ymm
// (8 S columns) and rows into even tiles of up to 6: a 6 x 2 tile keeps 12 accumulators, loads
// a strip's two vectors once per k for six rows, and keeps both FMA pipes busy. One row takes
// whole blocks (S = 8: eight chains, contiguous lines), two or three rows half blocks (S = 4).
// A strip's first tile streams it from memory, the others read it from L2 (K x 16 columns);
// meanwhile the tiles split between them a prefetch of this strip's quarter of the next block
// (contiguous lines), so the next block arrives while this one computes. Whole-block tiles
// prefetch their own block 16 k ahead (further ahead was slower).
// On a 2-core AMD EPYC (Zen 3, AVX2) oneDNN's packed fp32 matmul ran SmolLM2's decode
// linears, weights from memory, at 50-98 GFLOP/s for 8-48 rows, against the cores' ~180 FMA
// peak; this ran them 1.2-1.45x faster up to 96 rows (docs/design/packed-linears.md).
// Each output is the same sum in the same order (k = 0 .. K-1, one FMA each) whatever M and
// the tiling, so a row's result does not depend on the batch it came in.

#define LANES 8  // ymm vectors, also on AVX-512 builds (small_linear_bf16w is in every build)
#include "simd.h"   // vec, load_f32, load_bf16
#define MAX_TILE_ROWS 6
#define AHEAD_K 16  // whole-block tiles: k rows prefetched ahead
#define LINE 64     // bytes

static inline void store_vec(float *p, vec v) { memcpy(p, &v, sizeof(v)); }

#define STRIP_TILE(NAME, RR, SS) \
    NAME##_tile(w, x, K, N, bias, out, RR, SS, pf, pf_lines, pf_step, pf_every)

// NAME##_tile: rows [0, R) of x against one strip of S vectors starting at `w` (a block's
// column offset), while prefetching `pf_lines` lines from `pf` on (NULL: none), `pf_step`
// elements apart, one every `pf_every` k.
#define DEFINE_STRIPS(NAME, WT, LOADW)                                                         \
    INLINE void NAME##_tile(const WT *w, const float *x, int64_t K, int64_t N,                 \
                            const float *bias, float *out, const int R, const int S,           \
                            const WT *pf, int64_t pf_lines, int64_t pf_step, int pf_every) {   \
        vec acc[MAX_TILE_ROWS][8];                                                              \
        for (int r = 0; r < R; r++)                                                            \
            for (int s = 0; s < S; s++) acc[r][s] = (vec){0};                                   \
        /* the lines a strip's k row spans, at least one */                                    \
        const int lines = S * 8 * (int)sizeof(WT) > LINE ? S * 8 * (int)sizeof(WT) / LINE : 1; \
        int countdown = 1;                                                                     \
        for (int64_t k = 0; k < K; k++, w += COLS) {                                           \
            if (pf && pf_lines > 0 && --countdown == 0) {                                      \
                for (int line = 0; line < lines; line++)                                       \
                    __builtin_prefetch((const char *)pf + LINE * line, 0, 0);                  \
                pf += pf_step, pf_lines--, countdown = pf_every;                               \
            }                                                                                  \
            for (int r = 0; r < R; r++) {                                                      \
                const float xk = x[r * K + k];                                                 \
                for (int s = 0; s < S; s++) acc[r][s] += LOADW(w + 8 * s) * xk;                \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int s = 0; s < S; s++) {                                                      \
                vec v = acc[r][s];                                                             \
                if (bias) v += load_f32(bias + 8 * s);                                         \
                store_vec(out + r * N + 8 * s, v);                                             \
            }                                                                                  \
    }                                                                                          \
    /* a constant (R, S) per call, so the accumulators stay in registers */                   \
    static void NAME##_rows(const WT *w, const float *x, int64_t K, int64_t N,                 \
                            const float *bias, float *out, int R, int wide, const WT *pf,      \
                            int64_t pf_lines, int64_t pf_step, int pf_every) {                 \
        if (wide) {                                                                            \
            if (R == 1) STRIP_TILE(NAME, 1, 8);                                                \
            else if (R == 2) STRIP_TILE(NAME, 2, 4);                                           \
            else STRIP_TILE(NAME, 3, 4);                                                       \
        } else if (R == 1) STRIP_TILE(NAME, 1, 2);                                             \
        else if (R == 2) STRIP_TILE(NAME, 2, 2);                                               \
        else if (R == 3) STRIP_TILE(NAME, 3, 2);                                               \
        else if (R == 4) STRIP_TILE(NAME, 4, 2);                                               \
        else if (R == 5) STRIP_TILE(NAME, 5, 2);                                               \
        else STRIP_TILE(NAME, 6, 2);                                                           \
    }                                                                                          \
    /* out [M, N] = x [M, K] @ W^T + bias, N a multiple of 64, K of 16. Threads take       */  \
    /* contiguous runs of strips; each strip runs every row tile before the next strip.    */  \
    int NAME(const float *x, int64_t M, int64_t K, const WT *w, int64_t N, const float *bias,  \
             float *out, int64_t num_threads) {                                                \
        if (M < 0 || K <= 0 || N <= 0 || K % 16 || N % COLS || num_threads < 1) return 1;      \
        if (M == 0) return 0;                                                                  \
        const int wide = M <= 3; /* one tile of M rows over wider strips */                    \
        const int strip_cols = wide ? (M == 1 ? 64 : 32) : 16;                                 \
        const int64_t strips = N / strip_cols, per_line = LINE / (int64_t)sizeof(WT);          \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                 \
        for (int64_t strip = 0; strip < strips; strip++) {                                     \
            const int64_t col = strip * strip_cols, block = col / COLS;                        \
            const WT *ws = w + block * COLS * K + (col - block * COLS);                        \
            const float *b = bias ? bias + col : 0;                                            \
            if (wide) {                                                                        \
                NAME##_rows(ws, x, K, N, b, out + col, (int)M, 1, ws + AHEAD_K * COLS, K,      \
                            COLS, 1);                                                          \
                continue;                                                                      \
            }                                                                                  \
            /* this strip's quarter of the next block: 16 K contiguous elements */             \
            const WT *next = (block + 1) * COLS < N                                            \
                ? w + (block + 1) * COLS * K + (col - block * COLS) * K : 0;                   \
            const int64_t tiles = (M + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS;                     \
            const int64_t quarter = 16 * K / per_line, share = (quarter + tiles - 1) / tiles;  \
            /* rows dealt evenly: 8 rows run as 4 + 4, not 6 + 2 (4 FMA chains) */             \
            const int64_t base = M / tiles, extra = M % tiles;                                 \
            for (int64_t tile = 0, row = 0; tile < tiles; tile++) {                            \
                const int R = (int)(base + (tile < extra));                                    \
                const int64_t first = tile * share;                                            \
                const int64_t lines = first < quarter                                          \
                    ? (quarter - first < share ? quarter - first : share) : 0;                 \
                NAME##_rows(ws, x + row * K, K, N, b, out + row * N + col, R, 0,               \
                            next ? next + first * per_line : 0, lines, per_line, (int)tiles);  \
                row += R;                                                                      \
            }                                                                                  \
        }                                                                                      \
        return 0;                                                                              \
    }

#if !defined(__AVX512F__)
DEFINE_STRIPS(small_linear_f32, float, load_f32)
#endif
DEFINE_STRIPS(small_linear_bf16w, uint16_t, load_bf16)
