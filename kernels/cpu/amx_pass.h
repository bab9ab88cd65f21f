// The pass layout both AMX linears share (kernels/cpu/amx_linear.c for bf16,
// amx_linear_f32.c for fp32's bf16 parts): a weight packed as [N / 32][K / 2][32 columns][2]
// (oneDNN's AB16b32a2b), 32 rows of x under one 32-column block a pass, in four fp32
// accumulators. Include after immintrin.h.
#ifndef KVPAGER_AMX_PASS_H
#define KVPAGER_AMX_PASS_H

#include <string.h>

#include "amx.h"

#define COLS 32        // output columns of a packed block: two tiles of 16
#define K_STEP 32      // k of one tile product (16 pairs)
#define GROUP 32       // rows a pass of the accumulators covers: two tiles of 16
#define PREFETCH 4096  // bytes of weight ahead of the tile loads
#define ROW_CHUNK 128  // x's rows a chunk, under every column block of a thread
#define INLINE static inline __attribute__((always_inline))

// the tile registers (the intrinsics take literal numbers, so no enum)
#define T_A0 0   // x: rows 0-15 of the pass, 32 k              rows0 x 64 bytes
#define T_A1 1   //    rows 16-31                               rows1 x 64 bytes
#define T_B0 2   // weight: 16 k pairs x columns 0-15 of the block  16 x 64 bytes
#define T_B1 3   //         16 k pairs x columns 16-31              16 x 64 bytes
#define T_C00 4  // sums, rows 0-15 x columns 0-15 (fp32)      rows0 x 64 bytes
#define T_C01 5
#define T_C10 6  // rows 16-31
#define T_C11 7

// tiles for passes of rows0 + rows1 rows (rows1 may be 0: those tiles stay unused)
static void configure(int rows0, int rows1) {
    tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    const int rows[] = {rows0, rows1, 16, 16, rows0, rows0, rows1, rows1};
    for (int t = 0; t < 8; t++)
        if (rows[t]) config.rows[t] = (uint8_t)rows[t], config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

INLINE void prefetch_step(const char *w) {  // the 32 lines of one k step, PREFETCH ahead
    for (int line = 0; line < K_STEP * COLS * 2; line += 64)
        _mm_prefetch(w + PREFETCH + line, _MM_HINT_T0);
}

// a pass's two tile heights for `rows` (1-32) rows
INLINE int rows_high(int64_t rows) { return rows < 16 ? (int)rows : 16; }
INLINE int rows_low(int64_t rows) { return (int)rows - rows_high(rows); }

#endif
