// The AVX512-BF16 half of kernels/cpu/paged_tiles.c, for hosts without AMX (AMD Zen 4 and
// later, Cooper Lake): a chunk's q.k^T with vdpbf16ps, p.V with fp32 FMAs. Included by
// paged_tiles.c after its shapes (shape, unit, unit_state, CHUNK) are defined.
//
// The tile layout suits vdpbf16ps as it is: a K slab's 16 tokens of one dim pair are one zmm,
// and a query's dim pair broadcast against it gives 16 tokens' partial scores. A block of
// query rows x the chunk's tiles accumulates at once, so each K load serves every row and each
// broadcast every tile, and the dot products are independent chains. p.V stays in fp32: a V
// pair row (16 dims x 2 tokens) splits into its even and odd tokens with one shift and one and,
// and the weights keep all their bits (the output matches the float32 twin to ~1e-6). (The
// AMX half rounds them to bf16 once, where a second product for their low bits cost 19%.)
//
// P rounded to bf16 for prefill units (p.V on vdpbf16ps, half its instructions) gained nothing
// beyond the host's noise, so the weights keep all their bits. The measurements on a Zen 4 host:
// benchmarks/reports/2026-12-03-saturated-step-profile/.

#define SPREADS_PREFETCH 1  // a decode unit's prefetches go a few at a time between its products
#define QK_ROWS 4  // query rows a score block holds: 4 x 4 tiles = 16 accumulators
#define PV_ROWS 4  // rows and 16-dim slices an output block holds: 4 x 4 accumulators
#define PV_SLICES 4

int tiles_ready(void) { return 0; }  // no kernel permission to ask for

static void tiles_for_rows(int64_t rows) { (void)rows; }

static void tiles_done(void) {}

typedef struct {  // a chunk's softmax weights, in fp32
    float p[MAX_ROWS][CHUNK] __attribute__((aligned(64)));
} weights;

INLINE void keep_weights(weights *w, int64_t row, int64_t at, vec p) {
    memcpy(&w->p[row][at], &p, sizeof(p));
}

// the takes of a chunk of `keys_left` keys (or more): a score block's dim pairs and a value
// block's token pairs, for each block of rows
INLINE int64_t chunk_takes(const shape *s, const unit *u, int64_t keys_left) {
    const int64_t keys = keys_left < CHUNK ? keys_left + TILE_TOKENS - 1 : CHUNK;
    const int64_t tiles_in = keys / TILE_TOKENS;
    const int64_t row_blocks = (u->rows + QK_ROWS - 1) / QK_ROWS;
    const int64_t passes = (s->head_dim + PV_SLICES * 16 - 1) / (PV_SLICES * 16);
    return row_blocks * (s->head_dim / 2 + passes * tiles_in * TILE_TOKENS / 2);
}

// scores of rows [r0, r0 + R) over every tile: a tile past `tiles` reads the last one again
// and is not stored (the loads stay in the chunk's slabs)
INLINE void score_block(const shape *s, const unit *u, const uint16_t *const keys[],
                        int64_t tiles, float scores[][CHUNK], int64_t r0, const int R, ahead *a) {
    __m512 acc[QK_ROWS][CHUNK_TILES];
    const uint16_t *k[CHUNK_TILES];
    for (int t = 0; t < CHUNK_TILES; t++) k[t] = keys[t < tiles ? t : tiles - 1];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < CHUNK_TILES; t++) acc[r][t] = _mm512_setzero_ps();
    const int64_t pair_step = s->block_size * 2;  // bf16s from one dim pair's row to the next
    for (int64_t p = 0; p < s->head_dim / 2; p++) {
        ahead_take(a);
        __m512i kp[CHUNK_TILES];
        for (int t = 0; t < CHUNK_TILES; t++) kp[t] = _mm512_loadu_si512(k[t] + p * pair_step);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, u->query + (r0 + r) * u->query_step + 2 * p, sizeof(pair));
            const __m512bh q = (__m512bh)_mm512_set1_epi32(pair);
            for (int t = 0; t < CHUNK_TILES; t++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], q, (__m512bh)kp[t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < tiles; t++)
            _mm512_store_ps(&scores[r0 + r][t * TILE_TOKENS], acc[r][t]);
}

INLINE void chunk_scores(const shape *s, const unit *u, const uint16_t *const keys[],
                         int64_t tiles, float scores[][CHUNK], ahead *a) {
    for (int64_t r0 = 0; r0 < u->rows; r0 += QK_ROWS) {
        switch (u->rows - r0) {  // a literal R: the block's loops unroll into registers
            case 1: score_block(s, u, keys, tiles, scores, r0, 1, a); break;
            case 2: score_block(s, u, keys, tiles, scores, r0, 2, a); break;
            case 3: score_block(s, u, keys, tiles, scores, r0, 3, a); break;
            default: score_block(s, u, keys, tiles, scores, r0, 4, a); break;
        }
    }
}

// O[r0, r0 + R)[d0, d0 + 16 D) += P V over the chunk's tiles, in the unit's running output
INLINE void value_block(const shape *s, unit_state *st, const uint16_t *const values[],
                        int64_t tiles, const weights *w, int64_t r0, const int R, int64_t d0,
                        const int D, ahead *a) {
    __m512 acc[PV_ROWS][PV_SLICES];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < D; c++) acc[r][c] = _mm512_load_ps(&st->acc[r0 + r][d0 + c * 16]);
    const __m512i high = _mm512_set1_epi32((int32_t)0xffff0000);
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t j = 0; j < TILE_TOKENS / 2; j++) {  // token pair j: [dims][2 tokens]
            ahead_take(a);
            const uint16_t *v = values[t] + j * s->head_dim * 2 + d0 * 2;
            __m512 even[PV_SLICES], odd[PV_SLICES];
            for (int c = 0; c < D; c++) {
                const __m512i x = _mm512_loadu_si512(v + c * 32);
                even[c] = (__m512)_mm512_slli_epi32(x, 16);
                odd[c] = (__m512)_mm512_and_si512(x, high);
            }
            for (int r = 0; r < R; r++) {
                const float *p = &w->p[r0 + r][t * TILE_TOKENS + 2 * j];
                const __m512 pe = _mm512_set1_ps(p[0]), po = _mm512_set1_ps(p[1]);
                for (int c = 0; c < D; c++)
                    acc[r][c] =
                        _mm512_fmadd_ps(po, odd[c], _mm512_fmadd_ps(pe, even[c], acc[r][c]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < D; c++) _mm512_store_ps(&st->acc[r0 + r][d0 + c * 16], acc[r][c]);
}

#define VALUE_BLOCK(R)                                                                    \
    do {                                                                                  \
        if (slices == PV_SLICES) value_block(s, st, values, tiles, w, r0, R, d0, PV_SLICES, a); \
        else value_block(s, st, values, tiles, w, r0, R, d0, 2, a);                           \
    } while (0)

INLINE void chunk_values(const shape *s, const unit *u, unit_state *st,
                         const uint16_t *const values[], int64_t tiles, const weights *w,
                         ahead *a) {
    for (int64_t d0 = 0; d0 < s->head_dim; d0 += PV_SLICES * 16) {
        const int64_t left = (s->head_dim - d0) / 16;  // head_dim is a multiple of 32
        const int slices = left < PV_SLICES ? 2 : PV_SLICES;
        for (int64_t r0 = 0; r0 < u->rows; r0 += PV_ROWS) {
            switch (u->rows - r0) {
                case 1: VALUE_BLOCK(1); break;
                case 2: VALUE_BLOCK(2); break;
                case 3: VALUE_BLOCK(3); break;
                default: VALUE_BLOCK(4); break;
            }
        }
    }
}
