// The AMX half of kernels/cpu/paged_tiles.c: a chunk's q.k^T and p.V on the tile unit.
// Included by paged_tiles.c after its shapes (shape, unit, unit_state, CHUNK) are defined.
//
// P goes onto the tiles rounded to bf16 once, as torch's CPU flash attention and vLLM's AMX
// kernel round it: the fp32 output is within 2-3e-3 of the float32 twin on the tests' batches,
// nearer than the rounding to bf16 that follows leaves the twin itself (2-8e-3). Carried as
// bf16 twice (its rounding and what that left, ~1e-6 of the twin), P cost a second product
// and a second rounding a weight: 19% of a 1,000-token prefill's attention and 5-10% of a
// decode step's on a 2-core Xeon (benchmarks/reports/2026-12-06-xeon-amx-first-token/).
#include "amx.h"

// the tile registers (the intrinsics take literal numbers)
#define T_Q 0   // 32 dims of the unit's query rows       rows = rows, 64 bytes
#define T_K 1   // 32 dims (16 pairs) x 16 tokens         rows = 16, 64 bytes
#define T_S 2   // scores, rows x 16 tokens (fp32)       rows = rows, 64 bytes
#define T_P 3   // weights, rows x 16 tokens (bf16)      rows = rows, 32 bytes
#define T_V 4   // 8 token pairs x 16 dims               rows = 8, 64 bytes
#define T_O 5   // output, rows x 16 dims (fp32)         rows = rows, 64 bytes

// the tiles' shapes for units of `rows` query rows (a thread's units change rows rarely)
static void tiles_for_rows(int64_t rows) {
    tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    const uint8_t tile_rows[] = {rows, 16, rows, rows, 8, rows};
    const uint16_t colsb[] = {64, 64, 64, 32, 64, 64};
    for (int i = 0; i < 6; i++) config.rows[i] = tile_rows[i], config.colsb[i] = colsb[i];
    _tile_loadconfig(&config);
}

static void tiles_done(void) { _tile_release(); }

typedef struct {  // a chunk's softmax weights, as the tiles take them
    uint16_t p[MAX_ROWS][CHUNK] __attribute__((aligned(64)));
} weights;

// rounded to bf16 (nearest even, as torch: one vcvtneps2bf16)
INLINE void keep_weights(weights *w, int64_t row, int64_t at, vec p) {
    _mm256_storeu_si256((__m256i *)&w->p[row][at], (__m256i)_mm512_cvtneps_pbh((__m512)p));
}

// the takes a chunk spreads its prefetches over: none here
INLINE int64_t chunk_takes(const shape *s, const unit *u, int64_t keys_left) {
    (void)s, (void)u, (void)keys_left;
    return 1;
}

// S = Q K^T for the chunk's `tiles` tiles of 16 keys
INLINE void chunk_scores(const shape *s, const unit *u, const uint16_t *const keys[],
                         int64_t tiles, float scores[][CHUNK], ahead *a) {
    (void)a;  // prefetches go at once, before the chunk (no SPREADS_PREFETCH)
    for (int64_t t = 0; t < tiles; t++) {
        _tile_zero(T_S);
        for (int64_t c = 0; c < s->head_dim / 32; c++) {
            _tile_loadd(T_Q, u->query + c * 32, u->query_step * 2);
            _tile_loadd(T_K, keys[t] + c * 16 * s->block_size * 2, s->block_size * 4);
            _tile_dpbf16ps(T_S, T_Q, T_K);
        }
        _tile_stored(T_S, &scores[0][t * TILE_TOKENS], CHUNK * 4);
    }
}

// O += P V for the chunk, into the unit's running output
INLINE void chunk_values(const shape *s, const unit *u, unit_state *st,
                         const uint16_t *const values[], int64_t tiles, const weights *w,
                         ahead *a) {
    (void)a;
    float out[MAX_ROWS][16] __attribute__((aligned(64)));
    for (int64_t c = 0; c < s->head_dim / 16; c++) {
        _tile_zero(T_O);
        for (int64_t t = 0; t < tiles; t++) {
            _tile_loadd(T_V, values[t] + c * 32, s->head_dim * 4);
            _tile_loadd(T_P, &w->p[0][t * TILE_TOKENS], CHUNK * 2);
            _tile_dpbf16ps(T_O, T_P, T_V);
        }
        _tile_stored(T_O, out, 64);
        for (int64_t g = 0; g < u->rows; g++) {
            const vec a = load_f32(&st->acc[g][c * 16]) + load_f32(out[g]);
            memcpy(&st->acc[g][c * 16], &a, sizeof(a));
        }
    }
}
