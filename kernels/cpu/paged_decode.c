// Paged decode attention for CPUs: one query token per sequence, K/V read straight from the
// paged cache through the block table (no gathered copy), online softmax per block, GQA.
//
// Layouts (the engine's, see kernels/reference.py):
//   query  [num_seqs, num_heads, head_dim]                   float32, rows query_stride apart
//   cache  [num_blocks, block_size, num_kv_heads, head_dim]  float32, bfloat16, or fp8 e4m3 /
//                                                            e5m2 (K and V; decoded by fp8.h)
//   block_tables int32 [num_seqs, table_stride], seq_lens int32 [num_seqs]
//   out    [num_seqs, num_heads, head_dim]                   float32
// Work is split over (sequence, kv head) pairs on `num_threads` OpenMP threads; with enough
// sequences a thread takes every kv head of a sequence in turn (the lines the hardware fetched
// beside its head's rows are then in that core's L2 for the next head, where pairs dealt one
// by one to either thread would fetch them twice). The library
// links the libgomp that torch already loaded, so both share one runtime. Each K/V row is
// loaded once for all the query heads of its group: their dot products are independent FMA
// chains, which is what keeps the core busy (one chain per token stalls on FMA latency, 3x
// slower).
// While it works through a block it prefetches the next one, a row per token, into L2
// (locality 2): blocks sit anywhere, so the hardware prefetcher never sees them coming. Into
// L1 the prefetches stall on its few fill buffers; L2 keeps more misses in flight.
// `window` > 0 keeps the keys j with seq_len - 1 - window < j (the sliding window of the query
// at position seq_len - 1), `window` < 0 the keys of that query's chunk of -window tokens
// (Llama 4's chunked attention): the loop starts at the block holding the first of them and
// zeroes the weights before it. `softcap` > 0 maps each score s to softcap * tanh(s / softcap).
// `sinks` (NULL: none) holds a logit per query head (gpt-oss) that joins the softmax's
// denominator and adds no value: each head's running max starts at its sink, the sum at 1.
// An fp8 cache's scales are the caller's: it folds k_scale into `scale` and multiplies the
// output by v_scale (both linear), so the kernel reads the stored values as they are.
// Returns 0, or -1 for shapes it does not handle (head_dim not a multiple of 8, big groups).

// Eight lanes on every host, not simd.h's sixteen on AVX-512 ones: head_dim must be a multiple
// of the lanes (the tests' tiny models have head_dim 8), and sixteen gained too little to
// give that up (the kernel waits on memory, not on arithmetic).
#define LANES 8
#include "fp8.h"
#include "simd.h"

#define MAX_GROUP 16
#define MAX_CHUNKS 32  // head_dim up to 256
#define MAX_BLOCK_SIZE 256

static inline float hsum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

// Eight dot-product vectors -> one vector of their eight sums: a transpose-and-add tree
// (14 shuffles, 7 adds) where eight horizontal sums take ~60 lane extracts and adds. Scores
// then come eight tokens at a time, as vectors, and so do their exponentials.
static inline vec sum8(const vec d[8]) {
    const vec s01 = __builtin_shufflevector(d[0], d[1], 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(d[0], d[1], 1, 9, 3, 11, 5, 13, 7, 15);
    const vec s23 = __builtin_shufflevector(d[2], d[3], 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(d[2], d[3], 1, 9, 3, 11, 5, 13, 7, 15);
    const vec s45 = __builtin_shufflevector(d[4], d[5], 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(d[4], d[5], 1, 9, 3, 11, 5, 13, 7, 15);
    const vec s67 = __builtin_shufflevector(d[6], d[7], 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(d[6], d[7], 1, 9, 3, 11, 5, 13, 7, 15);
    // lanes: d0 d1 d0 d1 ... (pairs summed) -> d0 d1 d2 d3 (quads) for lanes 0-3 and 4-7
    const vec s0123 = __builtin_shufflevector(s01, s23, 0, 1, 8, 9, 4, 5, 12, 13) +
                      __builtin_shufflevector(s01, s23, 2, 3, 10, 11, 6, 7, 14, 15);
    const vec s4567 = __builtin_shufflevector(s45, s67, 0, 1, 8, 9, 4, 5, 12, 13) +
                      __builtin_shufflevector(s45, s67, 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(s0123, s4567, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(s0123, s4567, 4, 5, 6, 7, 12, 13, 14, 15);
}

// One (sequence, kv head) pair. Always inlined into the dispatch below with literal `group`
// and `chunks`, so the per-head loops unroll and the accumulators stay in registers (2.5x
// faster than the same code with runtime sizes). Keys go eight at a time: their dot products
// with every head of the group, summed by sum8, a block's running max, exponentials by
// vector_exp (lanes past the sequence's end are zeroed), then the weighted V rows.
#define DEFINE_ATTEND(NAME, CACHE_T, LOAD)                                                     \
static inline __attribute__((always_inline)) void NAME(                                        \
    const int64_t group, const int64_t chunks, const float *query, const CACHE_T *key_cache,   \
    const CACHE_T *value_cache, const int32_t *table, const int64_t seq_len, float *out,       \
    const int64_t token_stride, const int64_t block_stride, const int64_t block_size,          \
    const int64_t kv_head, const float scale, const int64_t window, const float softcap,      \
    const float *sinks) {                                                                      \
    vec q[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS];                                  \
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];                                      \
    vec scores[MAX_GROUP][MAX_BLOCK_SIZE / LANES];                                             \
    for (int64_t g = 0; g < group; g++) {                                                      \
        for (int64_t c = 0; c < chunks; c++) {                                                 \
            q[g][c] = load_f32(query + g * chunks * LANES + c * LANES) * scale;                \
            acc[g][c] = (vec){0};                                                              \
        }                                                                                      \
        running_max[g] = sinks ? sinks[g] : -INFINITY; /* the sink: exp(sink - max) = 1 */    \
        running_sum[g] = sinks ? 1.0f : 0.0f;                                                  \
    }                                                                                          \
    const int64_t first = window < 0 ? (seq_len - 1) / -window * -window                      \
                          : window > 0 && seq_len > window ? seq_len - window : 0;              \
    for (int64_t start = first / block_size * block_size; start < seq_len;                     \
         start += block_size) {                                                                \
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;         \
        const int64_t skip = first > start ? first - start : 0; /* keys left of the window */  \
        const int64_t num_octets = (n + LANES - 1) / LANES;                                    \
        const int64_t base = (int64_t)table[start / block_size] * block_stride                 \
                             + kv_head * chunks * LANES;                                       \
        const int64_t next = start + block_size < seq_len                                      \
            ? (int64_t)table[start / block_size + 1] * block_stride + kv_head * chunks * LANES \
            : -1;                                                                              \
        for (int64_t o = 0; o < num_octets; o++) {                                             \
            vec dot[MAX_GROUP][LANES];                                                         \
            for (int64_t j = 0; j < LANES; j++) {                                              \
                const int64_t t = o * LANES + j;                                               \
                for (int64_t g = 0; g < group; g++) dot[g][j] = (vec){0};                      \
                if (t >= n || t < skip) continue;                                              \
                const CACHE_T *k = key_cache + base + t * token_stride;                        \
                if (next >= 0) { /* the next block's row t: blocks sit anywhere, so the */     \
                                 /* hardware prefetcher never sees them coming */              \
                    const char *kn = (const char *)(key_cache + next + t * token_stride);      \
                    const char *vn = (const char *)(value_cache + next + t * token_stride);    \
                    for (int64_t b = 0; b < chunks * LANES * (int64_t)sizeof(CACHE_T);         \
                         b += 64) {                                                            \
                        __builtin_prefetch(kn + b, 0, 2);                                      \
                        __builtin_prefetch(vn + b, 0, 2);                                      \
                    }                                                                          \
                }                                                                              \
                vec d[MAX_GROUP]; /* in registers: one FMA chain per head */                   \
                for (int64_t g = 0; g < group; g++) d[g] = (vec){0};                           \
                for (int64_t c = 0; c < chunks; c++) {                                         \
                    const vec kc = LOAD(k + c * LANES);                                        \
                    for (int64_t g = 0; g < group; g++) d[g] += q[g][c] * kc;                  \
                }                                                                              \
                for (int64_t g = 0; g < group; g++) dot[g][j] = d[g];                          \
            }                                                                                  \
            for (int64_t g = 0; g < group; g++) {                                              \
                scores[g][o] = sum8(dot[g]);                                                   \
                if (softcap > 0.0f)                                                            \
                    for (int64_t j = 0; j < LANES; j++)                                        \
                        scores[g][o][j] = softcap * tanhf(scores[g][o][j] / softcap);          \
            }                                                                                  \
        }                                                                                      \
        for (int64_t g = 0; g < group; g++) {                                                  \
            float block_max = running_max[g];                                                  \
            for (int64_t o = 0; o < num_octets; o++) {                                         \
                const int64_t valid = n - o * LANES;                                           \
                for (int64_t j = skip > o * LANES ? skip - o * LANES : 0; j < LANES && j < valid; \
                     j++)                                                                      \
                    block_max = scores[g][o][j] > block_max ? scores[g][o][j] : block_max;     \
            }                                                                                  \
            const float correction = expf(running_max[g] - block_max);                         \
            running_sum[g] *= correction;                                                      \
            for (int64_t c = 0; c < chunks; c++) acc[g][c] *= correction;                      \
            running_max[g] = block_max;                                                        \
            vec sum = (vec){0};                                                                \
            for (int64_t o = 0; o < num_octets; o++) {                                         \
                vec p = vector_exp(scores[g][o] - block_max);                                  \
                const int64_t valid = n - o * LANES;                                           \
                for (int64_t j = valid; j < LANES; j++) p[j] = 0.0f;                           \
                for (int64_t j = 0; j < LANES && j < skip - o * LANES; j++) p[j] = 0.0f;       \
                scores[g][o] = p;                                                              \
                sum += p;                                                                      \
            }                                                                                  \
            running_sum[g] += hsum(sum);                                                       \
        }                                                                                      \
        for (int64_t t = skip; t < n; t++) {                                                   \
            const CACHE_T *v = value_cache + base + t * token_stride;                          \
            for (int64_t c = 0; c < chunks; c++) {                                             \
                const vec vc = LOAD(v + c * LANES);                                            \
                for (int64_t g = 0; g < group; g++)                                            \
                    acc[g][c] += scores[g][t / LANES][t % LANES] * vc;                         \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int64_t g = 0; g < group; g++) {                                                      \
        const float inv = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;                \
        for (int64_t c = 0; c < chunks; c++) {                                                 \
            const vec r = acc[g][c] * inv;                                                     \
            memcpy(out + g * chunks * LANES + c * LANES, &r, sizeof(r));                       \
        }                                                                                      \
    }                                                                                          \
}

#define CASE(ATTEND, G, C)                                                                     \
    if (group == G && chunks == C)                                                             \
        return ATTEND(G, C, query, key_cache, value_cache, table, seq_len, out, token_stride,  \
                      block_stride, block_size, kv_head, scale, window, softcap, sinks);
#define CASES_FOR_GROUP(ATTEND, G)                                                             \
    CASE(ATTEND, G, 8) CASE(ATTEND, G, 16)

// One (sequence, kv head) pair with literal sizes for head_dim 64/128 and groups 1-8,
// runtime sizes for anything else. The choice is made per pair, inside the OpenMP region:
// an outlined parallel region would otherwise see the sizes as variables again.
#define DEFINE_DISPATCH(NAME, ATTEND, CACHE_T)                                                 \
static void NAME(const int64_t group, const int64_t chunks, const float *query,               \
                 const CACHE_T *key_cache, const CACHE_T *value_cache, const int32_t *table,  \
                 const int64_t seq_len, float *out, const int64_t token_stride,                \
                 const int64_t block_stride, const int64_t block_size, const int64_t kv_head,  \
                 const float scale, const int64_t window, const float softcap,                 \
                 const float *sinks) {                                                         \
    CASES_FOR_GROUP(ATTEND, 1) CASES_FOR_GROUP(ATTEND, 2) CASES_FOR_GROUP(ATTEND, 3)           \
    CASES_FOR_GROUP(ATTEND, 4) CASES_FOR_GROUP(ATTEND, 5) CASES_FOR_GROUP(ATTEND, 6)           \
    CASES_FOR_GROUP(ATTEND, 7) CASES_FOR_GROUP(ATTEND, 8)                                      \
    ATTEND(group, chunks, query, key_cache, value_cache, table, seq_len, out, token_stride,    \
           block_stride, block_size, kv_head, scale, window, softcap, sinks);                  \
}

// The exported entry point: an OpenMP loop over (sequence, kv head) pairs, sequence-major.
#define DEFINE_DECODE(NAME, DISPATCH, CACHE_T)                                                 \
int NAME(const float *query, int64_t query_stride, const CACHE_T *key_cache,                   \
         const CACHE_T *value_cache, const int32_t *block_tables, int64_t table_stride,        \
         const int32_t *seq_lens, float *out, int64_t num_seqs, int64_t num_heads,             \
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_threads,      \
         float scale, int64_t window, float softcap, const float *sinks) {                     \
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim % LANES) return -1;           \
    const int64_t group = num_heads / num_kv_heads, chunks = head_dim / LANES;                 \
    if (group > MAX_GROUP || chunks > MAX_CHUNKS || block_size > MAX_BLOCK_SIZE) return -1;    \
    const int64_t token_stride = num_kv_heads * head_dim;                                      \
    const int64_t block_stride = block_size * token_stride;                                    \
    /* a thread takes a sequence's kv heads together, unless too few sequences for the threads */ \
    const int64_t per_task = num_seqs >= 4 * num_threads ? num_kv_heads : 1;                   \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, per_task) num_threads(num_threads)") \
    for (int64_t seq = 0; seq < num_seqs; seq++) {                                             \
        for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {                         \
            const int64_t first_head = seq * num_heads + kv_head * group;                      \
            DISPATCH(group, chunks, query + seq * query_stride + kv_head * group * head_dim,   \
                     key_cache, value_cache, block_tables + seq * table_stride,                \
                     seq_lens[seq], out + first_head * head_dim, token_stride, block_stride,   \
                     block_size, kv_head, scale, window, softcap,                              \
                     sinks ? sinks + kv_head * group : 0);                                     \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_ATTEND(attend_f32, float, load_f32)
DEFINE_ATTEND(attend_bf16, uint16_t, load_bf16)
DEFINE_DISPATCH(dispatch_f32, attend_f32, float)
DEFINE_DISPATCH(dispatch_bf16, attend_bf16, uint16_t)
DEFINE_DECODE(paged_decode_f32, dispatch_f32, float)
DEFINE_DECODE(paged_decode_bf16, dispatch_bf16, uint16_t)
DEFINE_ATTEND(attend_fp8_e4m3, uint8_t, load_fp8_e4m3)
DEFINE_ATTEND(attend_fp8_e5m2, uint8_t, load_fp8_e5m2)
DEFINE_DISPATCH(dispatch_fp8_e4m3, attend_fp8_e4m3, uint8_t)
DEFINE_DISPATCH(dispatch_fp8_e5m2, attend_fp8_e5m2, uint8_t)
DEFINE_DECODE(paged_decode_fp8_e4m3, dispatch_fp8_e4m3, uint8_t)
DEFINE_DECODE(paged_decode_fp8_e5m2, dispatch_fp8_e5m2, uint8_t)
