// Decode-sized linears (a few rows) reading oneDNN's packed weight in place: out[M, N] =
// x[M, K] @ W^T (+ bias), W the buffer `torch.ops.mkldnn._reorder_linear_weight` made at load.
// Its twin is kernels/reference.py's small_linear_ref (a plain matmul in float32, rounded once);
// kernels/small_linear.py checks the layout and calls it, engine/model/linear.py picks it.
//
// Why: at a few rows a linear only streams its weight, and oneDNN's packed matmul read it at
// 7-28 GB/s on a loaded 2-core AMD EPYC (Zen 4) where a plain read runs 26-33 GB/s from DRAM
// (docs/design/packed-linears.md has the numbers). Here each thread streams one contiguous
// run of 64-column blocks, front to back, with software prefetch, and keeps a block's
// accumulators in registers; no second copy of the weight is made.
//
// The layouts are oneDNN's on AVX-512 hosts (checked at load against a reorder in torch, so a
// host or version with another layout keeps oneDNN's matmul):
//   bf16  AB16b64a2b = [N / 64][K / 2][64 columns][2]  (k in pairs: vdpbf16ps' operand)
//   fp32  AB16b64a   = [N / 64][K][64 columns]
// bf16 rows run on vdpbf16ps where the build has AVX512-BF16 and otherwise widen each pair to
// two fp32 products (the same sums, in float32: products of bf16 values are exact there).
// Results are accumulated in float32 and rounded once (to nearest even) to the output dtype.

#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define COLS 64    // output columns of a weight block
#define TILES 4    // 16-column vectors a block holds
#define PREFETCH 1024  // bytes ahead of the loads (4 k pairs of bf16, 4 k of fp32)
// into every cache level (prefetcht0): on a 2-core Xeon with AMX the non-temporal hint this
// had (locality 0, chosen on AMD Zen 4) streamed a decode step's fp32 weights at 14 GB/s,
// slower than oneDNN (0.74x at 1 row, 0.51x at 8); into L1 it ran 1.07-1.14x oneDNN at 1-32
// rows, into L2 1.02-1.12x (benchmarks/reports/2026-12-06-xeon-amx-linears/)
#define PREFETCH_LOCALITY 3
#ifdef __AVX512F__
#define ROWS 6  // rows an accumulator block holds: 6 x 4 zmm (of 32)
#else
#define ROWS 1  // AVX2: 4 x 2 ymm a row, so more rows would spill
#endif
#define INLINE static inline __attribute__((always_inline))

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u16x32 __attribute__((vector_size(64)));  // 16 pairs of bf16

INLINE v16 load_v16(const void *p) {
    v16 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

INLINE void prefetch_lines(const char *p) {  // the four lines of one k step's 256 bytes
    for (int line = 0; line < 4; line++)
        __builtin_prefetch(p + PREFETCH + 64 * line, 0, PREFETCH_LOCALITY);
}

// acc += the 16 pairs of w (bf16, k even in the low half) times the pair x2 (same order)
INLINE v16 dot_pairs(v16 acc, const uint16_t *w, uint32_t x2) {
#ifdef __AVX512BF16__
    return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_loadu_si512(w),
                                 (__m512bh)_mm512_set1_epi32((int)x2));
#else
    u16x32 pairs;
    memcpy(&pairs, w, sizeof(pairs));
    const u16x32 even = pairs << 16, odd = pairs & 0xffff0000u;
    float x_even, x_odd;
    const uint32_t xe = x2 << 16, xo = x2 & 0xffff0000u;
    memcpy(&x_even, &xe, 4);
    memcpy(&x_odd, &xo, 4);
    return acc + (v16)odd * x_odd + (v16)even * x_even;
#endif
}

INLINE float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {  // to nearest even; NaN stays a quiet NaN
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if (f != f) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// rows [0, R) of one 64-column block: acc[r][t] holds columns 16t..16t+15 of row r
INLINE void block_bf16(const uint16_t *w, const uint16_t *x, int64_t K, v16 acc[][TILES],
                       const int R) {
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TILES; t++) acc[r][t] = (v16){0};
    for (int64_t p = 0; p < K / 2; p++, w += 2 * COLS) {
        prefetch_lines((const char *)w);
        for (int r = 0; r < R; r++) {
            uint32_t x2;
            memcpy(&x2, x + r * K + 2 * p, 4);
            for (int t = 0; t < TILES; t++) acc[r][t] = dot_pairs(acc[r][t], w + 32 * t, x2);
        }
    }
}

INLINE void block_f32(const float *w, const float *x, int64_t K, v16 acc[][TILES], const int R) {
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TILES; t++) acc[r][t] = (v16){0};
    for (int64_t k = 0; k < K; k++, w += COLS) {
        prefetch_lines((const char *)w);
        for (int r = 0; r < R; r++) {
            const float xk = x[r * K + k];
            for (int t = 0; t < TILES; t++) acc[r][t] += load_v16(w + 16 * t) * xk;
        }
    }
}

#define STORE_BLOCK(TYPE, TO_OUT, FROM_BIAS)                                                   \
    for (int r = 0; r < R; r++) {                                                              \
        float row[COLS];                                                                       \
        memcpy(row, acc[r], sizeof(row));                                                      \
        for (int c = 0; c < COLS; c++)                                                         \
            out[r * N + c] = TO_OUT(row[c] + (bias ? FROM_BIAS(bias[c]) : 0.0f));              \
    }

#define IDENTITY(v) (v)

// one 64-column block for rows [0, R): x, out and bias already offset to it
#define DEFINE_BLOCK_ROWS(NAME, TYPE, BLOCK, TO_OUT, FROM_BIAS)                                \
    static void NAME(const TYPE *w, const TYPE *x, int64_t K, int64_t N, const TYPE *bias,     \
                     TYPE *out, int R) {                                                       \
        v16 acc[ROWS][TILES];                                                                  \
        switch (R) { /* a constant row count, so the accumulators stay in registers */        \
            case 1: BLOCK(w, x, K, acc, 1); break;                                             \
            case 2: BLOCK(w, x, K, acc, ROWS >= 2 ? 2 : 1); break;                             \
            case 3: BLOCK(w, x, K, acc, ROWS >= 3 ? 3 : 1); break;                             \
            case 4: BLOCK(w, x, K, acc, ROWS >= 4 ? 4 : 1); break;                             \
            case 5: BLOCK(w, x, K, acc, ROWS >= 5 ? 5 : 1); break;                             \
            default: BLOCK(w, x, K, acc, ROWS); break;                                         \
        }                                                                                      \
        STORE_BLOCK(TYPE, TO_OUT, FROM_BIAS)                                                   \
    }

DEFINE_BLOCK_ROWS(block_rows_bf16, uint16_t, block_bf16, f32_to_bf16, bf16_to_f32)
#ifdef __AVX512F__
DEFINE_BLOCK_ROWS(block_rows_f32, float, block_f32, IDENTITY, IDENTITY)
#endif

// out [M, N] = x [M, K] @ W^T + bias; W packed as above, N a multiple of 64, K of 32 (bf16)
// or 16 (fp32); bias [N] or NULL. Threads take contiguous runs of column blocks.
#define DEFINE_SMALL_LINEAR(NAME, TYPE, BLOCK_ROWS, K_ALIGN)                                   \
    int NAME(const TYPE *x, int64_t M, int64_t K, const TYPE *w, int64_t N, const TYPE *bias, \
             TYPE *out, int64_t num_threads) {                                                 \
        if (M < 0 || K <= 0 || N <= 0 || K % K_ALIGN || N % COLS || num_threads < 1) return 1; \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                 \
        for (int64_t block = 0; block < N / COLS; block++) {                                   \
            const int64_t col = block * COLS;                                                  \
            for (int64_t row = 0; row < M; row += ROWS) {                                      \
                const int R = (int)(M - row < ROWS ? M - row : ROWS);                          \
                BLOCK_ROWS(w + col * K, x + row * K, K, N, bias ? bias + col : 0,              \
                           out + row * N + col, R);                                            \
            }                                                                                  \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_SMALL_LINEAR(small_linear_bf16, uint16_t, block_rows_bf16, 32)
#if defined(__AVX512F__)
DEFINE_SMALL_LINEAR(small_linear_f32, float, block_rows_f32, 16)
#endif
#include "small_linear_avx2.h"  // AVX2's small_linear_f32; small_linear_bf16w everywhere
