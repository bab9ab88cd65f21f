// Paged attention over a bf16 cache in the AMX tile unit's own layout, on AMX tiles
// (tiles_amx.h) or, on hosts without AMX, with AVX512-BF16 dot products (tiles_dpbf16.h), and
// the cache write that lays K/V out that way. The contract of kernels/reference.py's
// paged_attention_ref (a varlen batch: decode tokens and prefill chunks, block tables, windows)
// for a bf16 query and cache; soft-capped layers keep the token-major layout and are declined.
//
// Why: on AVX-512 the decode kernel's arithmetic and its reads of the cache add up instead of
// overlapping; on tiles the arithmetic shrinks to a fraction of the reads, so the kernel waits
// on memory alone. Prefill chunks read the cache in place too, where bf16 SDPA needed a
// gathered copy of each sequence's context. The measurements: benchmarks/reports/
// 2026-12-03-saturated-step-profile/.
//
// The tile layout, per block and kv head (a slab of block_size * head_dim values; a block is
// its kv heads' slabs back to back, so a block's size and its whole-block copies, swaps and
// disk files are the token-major layout's):
//   K  [head_dim / 2][block_size][2]   dims in pairs by token: the B operand of q.k^T
//   V  [block_size / 2][head_dim][2]   tokens in pairs by dim: the B operand of p.V
// Each 16 tokens of a slab are then one tile load for a 32-dim (K) or 16-dim (V) slice.
//
// The work comes in units of up to 16 query rows over one kv head's context (see `unit`): a
// decode token's group of query heads, or 16 tokens of a prefill chunk under one query head.
// Per unit, chunks of up to CHUNK_TILES x 16 keys: S = Q K^T (chunk_scores), an online softmax
// per chunk on 16-lane vectors (masked only where a row's causal or window edge crosses a
// tile), then O += P V (chunk_values); the two products are the ISA half's.
// Whole chunks are prefetched one ahead into L2, the next unit's first chunk included: on AMX
// in one burst a chunk (the same lines spread between the tile operations gained next to
// nothing there); the AVX512-BF16 half spreads them between its products, where on a Zen 4 a
// burst held its products back (a 64 x 320 decode step's attention 0.74 -> 0.60 ms a layer).
// Decode units alone prefetch: a prefill unit reads what the unit before it read (the same
// head, 16 keys fewer), already cached, and its prefetches only waited for fill buffers (7% of
// a 1,000-token prefill's attention; no gain either at 4k-16k tokens of context).
//
// Built for the host (kernels/cpu_build.py); with neither AMX nor AVX512-BF16 the attention
// entry point returns -1 (the write is plain C and always there).

#include <stdint.h>
#include <string.h>

// write_kv_tiles: token rows [num_tokens, num_kv_heads, head_dim] into a tile-layout cache.
// Plain C, no AMX: the twin of the write for hosts and tests without it. A token at an even
// offset followed by the next offset of its block (a prefill's tokens are) writes both rows
// at once, as whole 32-bit (V) and 64-bit (K) words; long writes are split over threads.
// Split over threads from PARALLEL_TOKENS tokens, a decode step's included, because each
// token's K lands on head_dim / 2 lines of its block, where a token-major row is one.
#define PARALLEL_TOKENS 32

static inline int pairs_with_next(const int64_t *slots, int64_t i, int64_t n, int64_t block_size) {
    return i + 1 < n && slots[i] >= 0 && slots[i] % 2 == 0 && slots[i] % block_size + 1 < block_size &&
           slots[i + 1] == slots[i] + 1;
}

static void write_one(const uint16_t *k, const uint16_t *v, uint16_t *kd, uint16_t *vd,
                      int64_t head_dim, int64_t block_size) {
    for (int64_t d = 0; d < head_dim; d += 2) {  // a dim pair stays together
        kd[d * block_size] = k[d];
        kd[d * block_size + 1] = k[d + 1];
    }
    for (int64_t d = 0; d < head_dim; d++) vd[d * 2] = v[d];
}

static void write_pair(const uint16_t *k0, const uint16_t *k1, const uint16_t *v0,
                       const uint16_t *v1, uint16_t *kd, uint16_t *vd, int64_t head_dim,
                       int64_t block_size) {
    uint32_t *v_words = (uint32_t *)vd;  // [dim][2 tokens]
    for (int64_t d = 0; d < head_dim; d++) v_words[d] = v0[d] | (uint32_t)v1[d] << 16;
    for (int64_t p = 0; p < head_dim / 2; p++) {  // [pair][2 tokens][2 dims]
        uint32_t w0, w1;
        memcpy(&w0, k0 + 2 * p, 4);
        memcpy(&w1, k1 + 2 * p, 4);
        const uint64_t both = w0 | (uint64_t)w1 << 32;
        memcpy(kd + p * block_size * 2, &both, 8);
    }
}

int write_kv_tiles_bf16(const uint16_t *key, const uint16_t *value, int64_t key_stride,
                        int64_t value_stride, uint16_t *key_cache, uint16_t *value_cache,
                        const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size) {
    const int64_t slab = block_size * head_dim, block_stride = num_kv_heads * slab;
#pragma omp parallel for schedule(static) if (num_tokens >= PARALLEL_TOKENS)
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0 || (i > 0 && pairs_with_next(slots, i - 1, num_tokens, block_size)))
            continue;  // padding, or the second of a pair its first wrote
        const int pair = pairs_with_next(slots, i, num_tokens, block_size);
        const int64_t block = slots[i] / block_size, t = slots[i] % block_size;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const uint16_t *k = key + i * key_stride + h * head_dim;
            const uint16_t *v = value + i * value_stride + h * head_dim;
            uint16_t *kd = key_cache + block * block_stride + h * slab + t * 2;
            uint16_t *vd = value_cache + block * block_stride + h * slab + (t / 2) * head_dim * 2 + t % 2;
            if (pair)
                write_pair(k, k + key_stride, v, v + value_stride, kd, vd, head_dim, block_size);
            else
                write_one(k, v, kd, vd, head_dim, block_size);
        }
    }
    return 0;
}

// The entry point's parameters: a varlen batch (cu_seqlens_q: where each sequence's query
// tokens start, as kernels/reference.py's paged_attention_ref), with AMX or without.
#define ATTENTION_PARAMS_OUT(OUT)                                                              \
    const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,                   \
        const uint16_t *value_cache, const int32_t *block_tables, int64_t table_stride,      \
        const int32_t *cu_seqlens_q, const int32_t *seq_lens, OUT, int64_t num_seqs,          \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,        \
        int64_t num_threads, float scale, int64_t window, float softcap, const float *sinks
#define ATTENTION_PARAMS ATTENTION_PARAMS_OUT(float *out)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define TILES_AMX 1
#elif defined(__AVX512BF16__) && defined(__AVX512F__)
#define TILES_DPBF16 1
#endif

#if defined(TILES_AMX) || defined(TILES_DPBF16)
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#include "steal.h"

#define LANES 16
#include "simd.h"

#define TILE_TOKENS 16
#define CHUNK_TILES 4  // 64 tokens a chunk: larger chunks were no faster and hold more scores
#define CHUNK (CHUNK_TILES * TILE_TOKENS)
#define MAX_ROWS 16    // a tile's rows
#define MAX_DIM 256
// the chunk's helpers inline into attend: called, they ran markedly slower
#define INLINE static inline __attribute__((always_inline))

static inline vec pick(ivec keep, vec a, vec b) {
    return (vec)(((ivec)a & keep) | ((ivec)b & ~keep));
}

// A unit of work: up to 16 query rows over one kv head's context in one sequence, either a
// decode token's group of query heads (the rows share one context), or 16 consecutive tokens
// of a prefill chunk under one query head (row r sees one key more than row r - 1: causal).
typedef struct {
    const uint16_t *query;  // row r at query + r * query_step
    char *out;              // row r at out + r * out_step values (fp32 or bf16: shape's)
    const int32_t *table;
    int64_t query_step, out_step, rows, kv_head;
    int64_t last, causal;   // row r sees the keys before last + r * causal (a window: fewer)
    int64_t head, head_step;  // row r is query head head + r * head_step (its sink's)
} unit;

typedef struct {  // the running softmax of a unit's rows
    float acc[MAX_ROWS][MAX_DIM] __attribute__((aligned(64)));
    float max[MAX_ROWS], sum[MAX_ROWS];
} unit_state;

typedef struct {  // what every unit of a call shares
    const uint16_t *key_cache, *value_cache;
    int64_t group, head_dim, num_heads, block_size, slab, block_stride;
    float scale;
    int64_t window;
    const float *sinks;  // a logit per query head that joins every softmax (gpt-oss); NULL: none
    int64_t out_bf16;    // rows out in bf16 (rounded to nearest even), else fp32
} shape;

static inline int64_t row_last(const unit *u, int64_t r) { return u->last + r * u->causal; }
static inline int64_t out_bytes(const shape *s) { return s->out_bf16 ? 2 : 4; }  // a value out

static inline int64_t row_first(const shape *s, int64_t last) {  // window < 0: its chunk's
    if (s->window < 0) return (last - 1) / -s->window * -s->window;
    return s->window > 0 && last > s->window ? last - s->window : 0;
}

static inline int64_t unit_start(const shape *s, const unit *u) {  // its first chunk's
    return row_first(s, u->last) / TILE_TOKENS * TILE_TOKENS;
}

static inline const uint16_t *slab_at(const shape *s, const uint16_t *cache, const int32_t *table,
                                      int64_t pos, int64_t kv_head, int64_t unit) {
    return cache + table[pos / s->block_size] * s->block_stride + kv_head * s->slab +
           (pos % s->block_size) * unit;
}

#define AHEAD_SLABS (2 * CHUNK_TILES)  // a chunk's K and V slabs

// The lines of the chunk a decode unit prefetches (into L2) while it works on the one before:
// a few at a time between its products (`ahead_take`, where the ISA half spreads them), the
// rest at the chunk's end (`ahead_flush`).
typedef struct {
    const char *base[AHEAD_SLABS];
    int64_t stride[AHEAD_SLABS];
    int64_t slabs, lines, slab, line, per_take;  // lines a slab; the next line; lines a take
} ahead;

// every line of the chunk of up to CHUNK tokens from `start` (none from `end`), planned
INLINE void plan_chunk(ahead *a, const shape *s, const int32_t *table, int64_t end,
                       int64_t start, int64_t kv_head) {
    for (int64_t pos = start; pos < end && pos < start + CHUNK; pos += TILE_TOKENS) {
        a->base[a->slabs] = (const char *)slab_at(s, s->key_cache, table, pos, kv_head, 2);
        a->stride[a->slabs++] = s->block_size * 4;  // a dim pair's 16 tokens
        const uint16_t *v = slab_at(s, s->value_cache, table, pos, kv_head, s->head_dim);
        a->base[a->slabs] = (const char *)v;
        a->stride[a->slabs++] = 64;  // the 16 tokens' values back to back
    }
}

INLINE void ahead_take(ahead *a) {
    for (int64_t n = 0; n < a->per_take && a->slab < a->slabs; n++) {
        __builtin_prefetch(a->base[a->slab] + a->line * a->stride[a->slab], 0, 2);
        if (++a->line == a->lines) a->line = 0, a->slab++;
    }
}

INLINE void ahead_flush(ahead *a) {
    a->per_take = a->lines * AHEAD_SLABS;
    ahead_take(a);
}

// V rows outside [lo, hi) may hold anything (NaN too, and 0 * NaN is NaN): a zeroed copy
static const uint16_t *masked_values(const shape *s, const uint16_t *v, int64_t lo, int64_t hi,
                                     uint16_t *copy) {
    for (int64_t r = 0; r < TILE_TOKENS; r++) {
        const int keep = r >= lo && r < hi;
        for (int64_t d = 0; d < s->head_dim; d++) {
            const int64_t at = (r / 2) * s->head_dim * 2 + d * 2 + r % 2;
            copy[at] = keep ? v[at] : 0;
        }
    }
    return copy;
}

#ifdef TILES_AMX
#include "tiles_amx.h"
#else
#include "tiles_dpbf16.h"
#endif

// a row's scores of the chunk, each tile masked where the row's window or causal edge crosses it
INLINE void row_scores(const shape *s, const unit *u, const float scores[][CHUNK], int64_t g,
                       int64_t tiles, int64_t start, vec x[CHUNK_TILES]) {
    ivec lane;
    for (int j = 0; j < LANES; j++) lane[j] = j;
    const int64_t last = row_last(u, g) - start, first = row_first(s, last + start) - start;
    for (int64_t t = 0; t < CHUNK_TILES; t++) {
        x[t] = (vec){0} - INFINITY;
        if (t >= tiles) continue;
        x[t] = load_f32(&scores[g][t * TILE_TOKENS]);
        if (first > t * TILE_TOKENS || last < (t + 1) * TILE_TOKENS) {
            const ivec at = lane + (int)(t * TILE_TOKENS);
            x[t] = pick((at >= (int)first) & (at < (int)last), x[t], (vec){0} - INFINITY);
        }
    }
}

// Scores of `tiles` tiles from `start` -> weights (as the ISA half keeps them), each row's
// running max, sum and output rescaled, in base 2 (scores times scale * log2(e)). Only a tile
// a row's window or causal edge crosses is masked; a row may see none of the chunk (a causal
// row before it): its weights are 0 and what it has stays. The rows' new maxima and their
// corrections are computed for all rows at once, one lane a row (MAX_ROWS == LANES): per row
// they were a horizontal reduction, a scalar exp2f call and a dependent chain each, and took
// most of a prefill chunk's softmax. The second pass reads and masks each row's scores again,
// from L1. (Its first form, masking every tile through memory with simd.h's exp and a
// bit-twiddled rounding, took most of a prefill chunk's time.)
INLINE void softmax_chunk(const shape *s, const unit *u, unit_state *st, float scores[][CHUNK],
                          weights *w, int64_t tiles, int64_t start) {
    const float to_base2 = s->scale * 1.44269504088896341f;
    float chunk_max[MAX_ROWS] __attribute__((aligned(64)));
    for (int64_t g = 0; g < MAX_ROWS; g++) chunk_max[g] = -INFINITY;
    for (int64_t g = 0; g < u->rows; g++) {
        vec x[CHUNK_TILES];
        row_scores(s, u, scores, g, tiles, start, x);
        vec top = x[0];
        for (int64_t t = 1; t < CHUNK_TILES; t++) top = (vec)_mm512_max_ps((__m512)top, (__m512)x[t]);
        chunk_max[g] = _mm512_reduce_max_ps((__m512)top) * to_base2;
    }
    const vec old_max = load_f32(st->max);
    const vec new_max = (vec)_mm512_max_ps((__m512)old_max, (__m512)load_f32(chunk_max));
    const vec none = (vec){0} - INFINITY;  // a row that has seen no key yet keeps 1
    const vec correction = pick(new_max == none, (vec){0} + 1.0f, exp2_lanes(old_max - new_max));
    memcpy(st->max, &new_max, sizeof(new_max));
    for (int64_t g = 0; g < u->rows; g++) {
        vec x[CHUNK_TILES];
        row_scores(s, u, scores, g, tiles, start, x);
        const float m = new_max[g];
        vec sum = (vec){0};
        for (int64_t t = 0; t < tiles; t++) {
            const vec p = pick(x[t] > none, exp2_lanes(x[t] * to_base2 - m), (vec){0});
            sum += p;
            keep_weights(w, g, t * TILE_TOKENS, p);
        }
        st->sum[g] = st->sum[g] * correction[g] + _mm512_reduce_add_ps((__m512)sum);
        if (correction[g] == 1.0f) continue;
        for (int64_t d = 0; d < s->head_dim; d += LANES) {
            const vec a = load_f32(&st->acc[g][d]) * correction[g];
            memcpy(&st->acc[g][d], &a, sizeof(a));
        }
    }
}

// One chunk of one unit: keys [start, start + CHUNK) of the context, none from `end` (its last
// row's last) or before `first` (its first row's window start).
INLINE void attend_chunk(const shape *s, const unit *u, unit_state *st, int64_t start,
                         int64_t first, int64_t end, ahead *a) {
    float scores[MAX_ROWS][CHUNK] __attribute__((aligned(64)));
    weights w;
    static __thread uint16_t copies[CHUNK_TILES][TILE_TOKENS * MAX_DIM] __attribute__((aligned(64)));
    const uint16_t *keys[CHUNK_TILES], *values[CHUNK_TILES];
    const int64_t left = (end - start + TILE_TOKENS - 1) / TILE_TOKENS;
    const int64_t tiles = left < CHUNK_TILES ? left : CHUNK_TILES;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t pos = start + t * TILE_TOKENS;
        keys[t] = slab_at(s, s->key_cache, u->table, pos, u->kv_head, 2);
        values[t] = slab_at(s, s->value_cache, u->table, pos, u->kv_head, s->head_dim);
        if (first > pos || end < pos + TILE_TOKENS)
            values[t] = masked_values(s, values[t], first - pos, end - pos, copies[t]);
    }
    chunk_scores(s, u, keys, tiles, scores, a);
    softmax_chunk(s, u, st, scores, &w, tiles, start);
    chunk_values(s, u, st, values, tiles, &w, a);
    ahead_flush(a);
}

// Plans the chunk after the one from `start`: this unit's, or where this is its last (`end`),
// `next`'s first; `takes`: the takes the chunk from `start` spreads them over.
INLINE void prefetch_ahead(const shape *s, const unit *u, const unit *next, int64_t start,
                           int64_t end, int64_t takes, ahead *a) {
    a->slabs = a->slab = a->line = 0;
    a->lines = s->head_dim / 2;  // a slab's 16 tokens: head_dim x 2 bytes x 16 / 64
    if (start + CHUNK < end)
        plan_chunk(a, s, u->table, end, start + CHUNK, u->kv_head);
    else if (next)
        plan_chunk(a, s, next->table, row_last(next, next->rows - 1), unit_start(s, next),
                   next->kv_head);
    a->per_take = (a->slabs * a->lines + takes - 1) / takes;
#ifndef SPREADS_PREFETCH
    ahead_flush(a);  // the ISA half takes none: all at once, before the chunk
#endif
}

// a row's output, acc * inv, rounded to bf16 (to nearest even, as torch's .to(bfloat16) of
// the fp32 row: the o_proj's input without a conversion pass over the step's attention out)
INLINE void store_bf16_row(const float *acc, float inv, uint16_t *row, int64_t head_dim) {
#ifdef __AVX512BF16__
    for (int64_t d = 0; d < head_dim; d += 32) {  // head_dim is a multiple of 32
        const vec lo = load_f32(acc + d) * inv, hi = load_f32(acc + d + 16) * inv;
        _mm512_storeu_si512(row + d, (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));
    }
#else
    (void)acc, (void)inv, (void)row, (void)head_dim;  // not built: the entry point declines
#endif
}

// One unit; `next`: the one this thread takes after it (NULL at the end), whose first chunk
// the last chunk prefetches.
static void attend(const shape *s, const unit *u, const unit *next) {
    unit_state st;
    for (int64_t g = 0; g < MAX_ROWS; g++) st.max[g] = -INFINITY, st.sum[g] = 0.0f;  // all lanes
    for (int64_t g = 0; g < u->rows; g++) {
        memset(st.acc[g], 0, s->head_dim * sizeof(float));
        if (s->sinks)  // the sink starts the running softmax, in base 2: exp2(max - max) = 1
            st.max[g] = s->sinks[u->head + g * u->head_step] * 1.44269504088896341f, st.sum[g] = 1.0f;
    }
    const int64_t first = row_first(s, u->last), end = row_last(u, u->rows - 1);
    ahead a = {.slabs = 0};
    for (int64_t start = unit_start(s, u); start < end; start += CHUNK) {
        if (!u->causal)  // decode units alone
            prefetch_ahead(s, u, next, start, end, chunk_takes(s, u, end - start), &a);
        attend_chunk(s, u, &st, start, first, end, &a);
    }
    for (int64_t g = 0; g < u->rows; g++) {
        const float inv = st.sum[g] > 0.0f ? 1.0f / st.sum[g] : 0.0f;
        if (s->out_bf16) {
            store_bf16_row(st.acc[g], inv, (uint16_t *)u->out + g * u->out_step, s->head_dim);
            continue;
        }
        float *row = (float *)u->out + g * u->out_step;
        for (int64_t d = 0; d < s->head_dim; d++) row[d] = st.acc[g][d] * inv;
    }
}

// A chunk of q_len tokens runs as prefill units (16 tokens under one query head) when it has
// more tokens than a kv head has query heads; shorter ones, decode tokens among them, run a
// decode unit per token and kv head.
static int prefill_units(int64_t q_len, int64_t group) { return q_len > group; }

static int64_t units_of(int64_t q_len, const shape *s) {
    if (!prefill_units(q_len, s->group)) return q_len * (s->num_heads / s->group);
    return s->num_heads * ((q_len + TILE_TOKENS - 1) / TILE_TOKENS);
}

// One sequence's units into `units`, kv head by kv head (a kv head's context stays in L2 while
// its units read it); returns how many.
static int64_t sequence_units(const shape *s, unit *units, const uint16_t *query,
                              int64_t query_stride, char *out, const int32_t *table,
                              int64_t q_len, int64_t seq_len) {
    const int64_t hd = s->head_dim, num_kv_heads = s->num_heads / s->group, first_last = seq_len - q_len + 1;
    const int64_t size = out_bytes(s);
    int64_t n = 0;
    if (!prefill_units(q_len, s->group)) {
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t i = 0; i < q_len; i++)
                units[n++] = (unit){query + i * query_stride + h * s->group * hd,
                                    out + (i * s->num_heads + h * s->group) * hd * size, table, hd, hd,
                                    s->group, h, first_last + i, 0, h * s->group, 1};
        return n;
    }
    for (int64_t head = 0; head < s->num_heads; head++)
        for (int64_t i = 0; i < q_len; i += TILE_TOKENS)
            units[n++] = (unit){query + i * query_stride + head * hd,
                                out + (i * s->num_heads + head) * hd * size, table, query_stride,
                                s->num_heads * hd, q_len - i < TILE_TOKENS ? q_len - i : TILE_TOKENS,
                                head / s->group, first_last + i, 1, head, 0};
    return n;
}

// what a unit costs, for the split over threads: its keys, weighted by its rows (each row's
// softmax) over the tile work every row shares
static int64_t unit_cost(const shape *s, const unit *u) {
    return (row_last(u, u->rows - 1) - unit_start(s, u) + 1) * (u->rows + 8);
}

// Threads' contiguous runs holding equal shares of the cost (a unit goes where its middle
// falls), so the unit a thread prefetches for is usually its own next one.
static void split_runs(const shape *s, const unit *units, int64_t n, int64_t threads,
                       run *runs) {
    int64_t total = 0, seen = 0, at = 0;
    for (int64_t i = 0; i < n; i++) total += unit_cost(s, &units[i]);
    for (int64_t t = 0; t < threads; t++) {
        const int64_t first = at, to = total * (t + 1) / threads;
        while (at < n && seen + unit_cost(s, &units[at]) / 2 < to) seen += unit_cost(s, &units[at++]);
        runs[t] = run_of((uint64_t)first, (uint64_t)(t + 1 == threads ? n : at));
    }
}

// Each thread runs its own run, then takes what is left of the others' (steal.h); a team
// smaller than asked for still runs every unit.
static void run_units(const shape *s, const unit *units, int64_t n, int64_t num_threads) {
    run runs[MAX_RUNS];
    num_threads = team_size(num_threads);
    split_runs(s, units, n, num_threads, runs);
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t me = omp_get_thread_num();
        int64_t rows = -1, k = 0, i;
        while ((i = next_item(runs, num_threads, me, &k)) >= 0) {
            if (units[i].rows != rows) tiles_for_rows(rows = units[i].rows);
            const int64_t next = k ? i - 1 : i + 1;  // the way this run is being taken
            attend(s, &units[i], next >= 0 && next < n ? &units[next] : 0);
        }
        if (rows >= 0) tiles_done();
    }
}

// Every query token of the batch into out [num_tokens, heads, d], fp32 or bf16.
static int attention_tiles(ATTENTION_PARAMS_OUT(void *out), int64_t out_bf16) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim % 32 || head_dim > MAX_DIM ||
        block_size % TILE_TOKENS || num_heads / num_kv_heads > MAX_ROWS || softcap > 0.0f)
        return -1;  // a soft-capped layer has the token-major layout (kernels/cpu_tiles.py fits)
    const shape s = {key_cache, value_cache, num_heads / num_kv_heads, head_dim, num_heads,
                     block_size, block_size * head_dim, block_size * num_kv_heads * head_dim,
                     scale, window, sinks, out_bf16};
    int64_t n = 0;
    for (int64_t seq = 0; seq < num_seqs; seq++) {
        const int64_t q_len = cu_seqlens_q[seq + 1] - cu_seqlens_q[seq];
        if (q_len < 0 || seq_lens[seq] < q_len) return -1;
        n += units_of(q_len, &s);
    }
    if (n >= INT32_MAX) return -1;  // unit indices share a word in run_units
    unit *units = malloc((n ? n : 1) * sizeof(unit));
    if (!units) return -1;
    n = 0;
    for (int64_t seq = 0; seq < num_seqs; seq++) {
        const int64_t token = cu_seqlens_q[seq];
        n += sequence_units(&s, units + n, query + token * query_stride, query_stride,
                            (char *)out + token * num_heads * head_dim * out_bytes(&s),
                            block_tables + seq * table_stride, cu_seqlens_q[seq + 1] - token,
                            seq_lens[seq]);
    }
    run_units(&s, units, n, num_threads);
    free(units);
    return 0;
}

// The exported entry points: fp32 out, and bf16 out (where the build has AVX512-BF16's
// conversion: else -1, and the caller takes fp32)
int paged_attention_tiles_bf16(ATTENTION_PARAMS) {
    return attention_tiles(query, query_stride, key_cache, value_cache, block_tables, table_stride,
                           cu_seqlens_q, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                           head_dim, block_size, num_threads, scale, window, softcap, sinks, 0);
}

int paged_attention_tiles_bf16_out(ATTENTION_PARAMS_OUT(uint16_t *out)) {
#ifdef __AVX512BF16__
    return attention_tiles(query, query_stride, key_cache, value_cache, block_tables, table_stride,
                           cu_seqlens_q, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                           head_dim, block_size, num_threads, scale, window, softcap, sinks, 1);
#else
    return -1;
#endif
}

#else  // neither AMX nor AVX512-BF16 in this build

int tiles_ready(void) { return -1; }

int paged_attention_tiles_bf16(ATTENTION_PARAMS) {
    return -1;
}

int paged_attention_tiles_bf16_out(ATTENTION_PARAMS_OUT(uint16_t *out)) {
    return -1;
}

#endif
