// Latent paged attention for CPUs (DeepSeek's MLA, absorbed): one query row per token, the
// latent pages read in place through the block table, online softmax per block.
//
// Layouts (engine/model/mla.py's latent pages; kernels/mla_absorb.py builds the query):
//   query  [num_rows, num_heads, 2 * half]  float32: [q_nope . W_UK | q_pe] per head, each
//                                           half already times its plane's fp8 scale
//   cache  [num_blocks, block_size, half]   K plane and V plane (a row [latent | rope key]
//                                           split in halves); float32, bfloat16 or fp8
//   block_tables int32 [num_rows, table_stride], seq_lens int32 [num_rows] (keys each sees)
//   out    [num_rows, num_heads, 2 * half]  float32: softmax . row per head (stored values;
//                                           the caller scales the halves, keeps the latent)
// Every head attends over the same rows (the latent is shared, MQA-like), so a task takes a
// tile of up to HEAD_TILE heads of one row and reads each cache row once for all of them.
// Tasks (row, head tile) are spread over `num_threads` OpenMP threads. Vectors are simd.h's
// (sixteen lanes on AVX-512 hosts, eight on AVX2 ones); half must be a multiple of them.
// Returns 0, or -1 for shapes it does not handle (then the caller keeps the torch twin).

#include "fp8.h"
#include "simd.h"

#define HEAD_TILE 16
#define MAX_HALF 512
#define MAX_BLOCK_SIZE 256
#define MAX_CHUNKS (2 * MAX_HALF / LANES)

static inline float hsum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

// One (row, head tile) task. acc holds, per head, the K plane's chunks then the V plane's.
#define DEFINE_TILE(NAME, CACHE_T, LOAD)                                                       \
static void NAME(const int64_t heads, const int64_t chunks, const float *query,               \
                 const CACHE_T *key_cache, const CACHE_T *value_cache, const int32_t *table,  \
                 const int64_t seq_len, float *out, const int64_t block_size,                  \
                 const float scale) {                                                          \
    const int64_t half = chunks * LANES, row = 2 * half;                                       \
    vec acc[HEAD_TILE][MAX_CHUNKS];                                                            \
    float running_max[HEAD_TILE], running_sum[HEAD_TILE], p[HEAD_TILE][MAX_BLOCK_SIZE];        \
    for (int64_t g = 0; g < heads; g++) {                                                      \
        for (int64_t c = 0; c < 2 * chunks; c++) acc[g][c] = (vec){0};                         \
        running_max[g] = -INFINITY;                                                            \
        running_sum[g] = 0.0f;                                                                 \
    }                                                                                          \
    for (int64_t start = 0; start < seq_len; start += block_size) {                            \
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;         \
        const int64_t base = (int64_t)table[start / block_size] * block_size * half;           \
        const CACHE_T *k_block = key_cache + base, *v_block = value_cache + base;              \
        for (int64_t t = 0; t < n; t++) { /* scores: both planes' dots, every head */         \
            vec d[HEAD_TILE];                                                                  \
            for (int64_t g = 0; g < heads; g++) d[g] = (vec){0};                               \
            for (int64_t c = 0; c < chunks; c++) {                                             \
                const vec kc = LOAD(k_block + t * half + c * LANES);                           \
                const vec vc = LOAD(v_block + t * half + c * LANES);                           \
                for (int64_t g = 0; g < heads; g++)                                            \
                    d[g] += load_f32(query + g * row + c * LANES) * kc                         \
                            + load_f32(query + g * row + half + c * LANES) * vc;               \
            }                                                                                  \
            for (int64_t g = 0; g < heads; g++) p[g][t] = hsum(d[g]) * scale;                  \
        }                                                                                      \
        for (int64_t g = 0; g < heads; g++) { /* the block's max, weights, rescaled sums */   \
            float block_max = running_max[g];                                                  \
            for (int64_t t = 0; t < n; t++) block_max = p[g][t] > block_max ? p[g][t] : block_max; \
            const float correction = expf(running_max[g] - block_max);                         \
            running_max[g] = block_max;                                                        \
            running_sum[g] *= correction;                                                      \
            for (int64_t c = 0; c < 2 * chunks; c++) acc[g][c] *= correction;                  \
            for (int64_t t = 0; t < n; t++) {                                                  \
                p[g][t] = expf(p[g][t] - block_max);                                           \
                running_sum[g] += p[g][t];                                                     \
            }                                                                                  \
        }                                                                                      \
        for (int64_t t = 0; t < n; t++) { /* weighted rows: each chunk loaded once */         \
            for (int64_t c = 0; c < chunks; c++) {                                             \
                const vec kc = LOAD(k_block + t * half + c * LANES);                           \
                const vec vc = LOAD(v_block + t * half + c * LANES);                           \
                for (int64_t g = 0; g < heads; g++) {                                          \
                    acc[g][c] += p[g][t] * kc;                                                 \
                    acc[g][chunks + c] += p[g][t] * vc;                                        \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int64_t g = 0; g < heads; g++) {                                                      \
        const float inv = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;                \
        for (int64_t c = 0; c < 2 * chunks; c++) {                                             \
            const vec r = acc[g][c] * inv;                                                     \
            memcpy(out + g * row + c * LANES, &r, sizeof(r));                                  \
        }                                                                                      \
    }                                                                                          \
}

// The exported entry point: an OpenMP loop over (row, head tile) tasks.
#define DEFINE_DECODE(NAME, TILE, CACHE_T)                                                     \
int NAME(const float *query, const CACHE_T *key_cache, const CACHE_T *value_cache,             \
         const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,           \
         float *out, int64_t num_rows, int64_t num_heads, int64_t half, int64_t block_size,    \
         int64_t num_threads, float scale) {                                                   \
    if (half % LANES || half > MAX_HALF || block_size > MAX_BLOCK_SIZE || num_heads < 1)       \
        return -1;                                                                             \
    const int64_t tiles = (num_heads + HEAD_TILE - 1) / HEAD_TILE, row = 2 * half;             \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")     \
    for (int64_t r = 0; r < num_rows; r++) {                                                   \
        for (int64_t tile = 0; tile < tiles; tile++) {                                         \
            const int64_t first = tile * HEAD_TILE;                                            \
            const int64_t heads = num_heads - first < HEAD_TILE ? num_heads - first : HEAD_TILE; \
            const int64_t offset = (r * num_heads + first) * row;                              \
            TILE(heads, half / LANES, query + offset, key_cache, value_cache,                  \
                 block_tables + r * table_stride, seq_lens[r], out + offset, block_size,       \
                 scale);                                                                       \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_TILE(tile_f32, float, load_f32)
DEFINE_TILE(tile_bf16, uint16_t, load_bf16)
DEFINE_TILE(tile_fp8_e4m3, uint8_t, load_fp8_e4m3)
DEFINE_TILE(tile_fp8_e5m2, uint8_t, load_fp8_e5m2)
DEFINE_DECODE(mla_decode_f32, tile_f32, float)
DEFINE_DECODE(mla_decode_bf16, tile_bf16, uint16_t)
DEFINE_DECODE(mla_decode_fp8_e4m3, tile_fp8_e4m3, uint8_t)
DEFINE_DECODE(mla_decode_fp8_e5m2, tile_fp8_e5m2, uint8_t)
