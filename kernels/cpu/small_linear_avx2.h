// small_linear_f32 for AVX2 hosts without AVX-512 (included by small_linear.c): up to a few
// dozen rows over oneDNN's packed fp32 weight, [N / 64][K][64 columns], read in place.
//
// Why its own shape: a ymm holds 8 columns, so a 64-column block's row is 8 registers and the
// AVX-512 code's 6 x 64 accumulator tile would spill. Here the weight is cut into strips of
// S ymm (8 S columns) of one block, and rows into tiles of up to 6: a 6 x 2 tile keeps 12
// accumulators, loads a strip's two vectors once per k for six rows, and keeps both FMA
// pipes busy (12 independent chains). One row (M = 1) takes whole blocks (S = 8: eight
// chains, four contiguous lines a k); two or three rows take S = 4.
// A strip's first row tile streams it from memory (prefetched a few k ahead: the strip's lines
// sit 256 bytes apart, which the hardware prefetcher follows late), the others read it from
// L2 (a strip is K x 64 bytes: 36 KB for K = 576, 96 KB for K = 1536).
// On a 2-core AMD EPYC (Zen 3, AVX2) oneDNN's packed matmul ran SmolLM2's decode linears,
// weights from memory, at 50-98 GFLOP/s for 8-48 rows, against the cores' ~180 FMA peak
// (docs/design/packed-linears.md has the table).
// Each output is the same sum in the same order (k = 0 .. K-1, one FMA each) whatever M and
// the tiling, so a row's result does not depend on the batch it came in.

typedef float v8 __attribute__((vector_size(32)));
#define MAX_TILE_ROWS 6
#ifndef PF_MODE
#define PF_MODE 1
#endif
#ifndef PF_LOCALITY
#define PF_LOCALITY 0
#endif
#ifndef PF_AHEAD
#define PF_AHEAD 16
#endif
// wide tiles stream their own strip PF_AHEAD k ahead; narrow ones the next panel's quarter
#define PF_LINES(S) (S == 2 && PF_MODE ? 1 : S / 2)
#define PF_STRIDE(S) (S == 2 && PF_MODE ? 16 : COLS)

INLINE v8 load_v8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

INLINE void store_v8(float *p, v8 v) { memcpy(p, &v, sizeof(v)); }

// rows [0, R) of x against one strip of S vectors starting at `w` (a block's column offset).
// Meanwhile it prefetches `pf_lines` k rows of the next strip, from `pf` on (NULL: none), one
// every `pf_every` k: the strip's row tiles split its successor between them, so the next
// strip streams in from memory while this one computes from L2.
INLINE void strip_tile(const float *w, const float *x, int64_t K, int64_t N, const float *bias,
                       float *out, const int R, const int S, const float *pf, int64_t pf_lines,
                       int pf_every) {
    v8 acc[MAX_TILE_ROWS][8];
    for (int r = 0; r < R; r++)
        for (int s = 0; s < S; s++) acc[r][s] = (v8){0};
    int countdown = 1;
    for (int64_t k = 0; k < K; k++, w += COLS) {
        if (pf && pf_lines > 0 && --countdown == 0) {
            for (int line = 0; line < PF_LINES(S); line++)
                __builtin_prefetch(pf + 16 * line, 0, PF_LOCALITY);
            pf += PF_STRIDE(S), pf_lines--, countdown = pf_every;
        }
        for (int r = 0; r < R; r++) {
            const float xk = x[r * K + k];
            for (int s = 0; s < S; s++) acc[r][s] += load_v8(w + 8 * s) * xk;
        }
    }
    for (int r = 0; r < R; r++)
        for (int s = 0; s < S; s++) {
            v8 v = acc[r][s];
            if (bias) v += load_v8(bias + 8 * s);
            store_v8(out + r * N + 8 * s, v);
        }
}

// a constant (R, S) per call, so the accumulators stay in registers
#define TILE_CASE(RR, SS) \
    case RR: strip_tile(w, x, K, N, bias, out, RR, SS, pf, pf_lines, pf_every); break;

static void strip_rows_s2(const float *w, const float *x, int64_t K, int64_t N,
                          const float *bias, float *out, int R, const float *pf,
                          int64_t pf_lines, int pf_every) {
    switch (R) {
        TILE_CASE(1, 2) TILE_CASE(2, 2) TILE_CASE(3, 2) TILE_CASE(4, 2) TILE_CASE(5, 2)
        default: strip_tile(w, x, K, N, bias, out, 6, 2, pf, pf_lines, pf_every); break;
    }
}

static void strip_rows_wide(const float *w, const float *x, int64_t K, int64_t N,
                            const float *bias, float *out, int R, const float *pf,
                            int64_t pf_lines, int pf_every) {
    switch (R) {
        TILE_CASE(1, 8) TILE_CASE(2, 4)
        default: strip_tile(w, x, K, N, bias, out, 3, 4, pf, pf_lines, pf_every); break;
    }
}

// where strip `strip` of `strip_cols` columns starts in W
INLINE const float *strip_start(const float *w, int64_t K, int64_t strip, int strip_cols) {
    const int64_t col = strip * strip_cols, block = col / COLS;
    return w + block * COLS * K + (col - block * COLS);
}

// out [M, N] = x [M, K] @ W^T + bias, W packed as above, N a multiple of 64, K of 16. Threads
// take contiguous runs of strips; each strip runs every row tile before the next strip.
int small_linear_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                     const float *bias, float *out, int64_t num_threads) {
    if (M < 0 || K <= 0 || N <= 0 || K % 16 || N % COLS || num_threads < 1) return 1;
    if (M == 0) return 0;
    const int wide = M <= 3;  // one tile of M rows over wider strips
    const int strip_cols = wide ? (M == 1 ? 64 : 32) : 16;
    const int64_t strips = N / strip_cols;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t strip = 0; strip < strips; strip++) {
        const int64_t col = strip * strip_cols;
        const float *ws = strip_start(w, K, strip, strip_cols), *b = bias ? bias + col : 0;
        const float *next = strip + 1 < strips ? strip_start(w, K, strip + 1, strip_cols) : 0;
        if (wide) {
            strip_rows_wide(ws, x, K, N, b, out + col, (int)M, ws + PF_AHEAD * COLS, K, 1);
            continue;
        }
        const int64_t tiles = (M + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS;
#if PF_MODE
        // this strip's quarter of the next block, k rows apart by 64 bytes: contiguous lines
        const int64_t q = (col % COLS) / 16;
        next = (col / COLS + 1) * COLS < N ? w + (col / COLS + 1) * COLS * K + q * 16 * K : 0;
#endif
        const int64_t share = (K + tiles - 1) / tiles;  // next strip's k rows a tile prefetches
        // rows dealt evenly: 8 rows run as 4 + 4, not 6 + 2 (a 2-row tile keeps 4 FMA chains)
        const int64_t base = M / tiles, extra = M % tiles;
        for (int64_t tile = 0, row = 0; tile < tiles; tile++) {
            const int R = (int)(base + (tile < extra)), first = (int)(tile * share);
            const int64_t lines = first < K ? (K - first < share ? K - first : share) : 0;
            strip_rows_s2(ws, x + row * K, K, N, b, out + row * N + col, R,
                          next ? next + first * PF_STRIDE(2) : 0, lines, (int)tiles);
            row += R;
        }
    }
    return 0;
}
