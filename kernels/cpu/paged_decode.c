// Paged decode attention for CPUs: one query token per sequence, K/V read straight from the
// paged cache through the block table (no gathered copy), online softmax, GQA.
//
// Layouts (the engine's, see kernels/reference.py):
//   query  [num_seqs, num_heads, head_dim]                   float32, rows query_stride apart
//   cache  [num_blocks, block_size, num_kv_heads, head_dim]  float32, bfloat16, or fp8 e4m3 /
//                                                            e5m2 (K and V; decoded by fp8.h)
//   block_tables int32 [num_seqs, table_stride], seq_lens int32 [num_seqs]
//   out    [num_seqs, num_heads, head_dim]                   float32
// Work is split over tasks on `num_threads` OpenMP threads: a task is a sequence's kv heads
// together (up to MAX_GROUP query rows), or one kv head where there are too few sequences to
// keep the threads busy. A task goes block by block: a block's K rows, contiguous for all its
// heads, are read once for all of them (a head at a time, its rows 256 bytes in every 768 for
// SmolLM2, left the lines beside them to be fetched again for the next head). The library
// links the libgomp that torch already loaded, so both share one runtime. Each K/V row is
// loaded once for all the query heads of its group: their dot products are independent FMA
// chains, which is what keeps the core busy (one chain per token stalls on FMA latency, 3x
// slower). The softmax runs over segments of up to SEGMENT tokens, not block by block.
// While it works through a block it prefetches the next one's keys and its own values into L2
// (locality 2): blocks sit anywhere, so the hardware prefetcher never sees them coming. Into
// L1 the prefetches stall on its few fill buffers; L2 keeps more misses in flight.
// `window` > 0 keeps the keys j with seq_len - 1 - window < j (the sliding window of the query
// at position seq_len - 1), `window` < 0 the keys of that query's chunk of -window tokens
// (Llama 4's chunked attention): the loop starts at the block holding the first of them and
// masks the keys before it out. `softcap` > 0 maps each score s to softcap * tanh(s / softcap).
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

static inline vec vmax(vec a, vec b) {
    const ivec greater = a > b;
    return (vec)(((ivec)a & greater) | ((ivec)b & ~greater));
}

static inline float hmax(vec v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

// `rows` rows of `row_bytes`, `step` bytes apart, into L2 (locality 2)
static inline void prefetch_rows(const char *row, const int64_t step, const int64_t rows,
                                 const int64_t row_bytes) {
    for (int64_t i = 0; i < rows; i++, row += step)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
}

// Tokens a score tile takes at once, by group size: tokens x group FMA chains, enough to keep
// both FMA pipes busy through their latency and few enough for 16 registers.
#define MAX_TILE 8
#define TILE_TOKENS(group) ((group) == 1 ? 8 : (group) <= 3 ? 4 : (group) <= 6 ? 2 : 1)
// Softmax segments: the scores of up to SEGMENT tokens (whole blocks) are all computed before
// their softmax and weighted values, so its bookkeeping (the running max's correction, the
// accumulators' rescale and reloads) is paid per segment, not per block.
#define SEGMENT 256
#define SEGMENT_OCTETS (SEGMENT / LANES)

// One segment's two passes for one kv head, always inlined with literal group and chunks.
//   scores: one block's keys against the group's query rows, TILE_TOKENS keys at a time (a key
//     row is loaded once for the whole group), eight tokens' dot products summed by sum8.
//     Rows past the block's end are not loaded (a short block may be the cache's last).
//     Meanwhile it prefetches this head's rows of the next block's keys and of this block's
//     values (`v`), a token row at a time, spread over the arithmetic so that the prefetches
//     never queue up: the values pass then reads the segment's values from L2. (Values
//     prefetched a block ahead in the values pass itself measured no faster; fetched during
//     the scores, a 64 x 320 fp32 step's attention took 8-16% less on a Zen 4, bf16 27%.)
//   values: acc = acc * correction + sum_t p_t v_t over the segment's blocks, a query row at a
//     time, up to eight chunks of its accumulators in registers across all the tokens: eight
//     independent FMA chains, each a token apart, which is what the FMA latency needs (the
//     group's rows together, fewer chunks each, waited on it: 1.3x slower from L2).
#define DEFINE_SEGMENT_PASSES(SUFFIX, CACHE_T, LOAD)                                           \
static inline __attribute__((always_inline)) void scores_##SUFFIX(                            \
    const int64_t group, const int64_t chunks, vec (*q)[MAX_CHUNKS], const CACHE_T *k,         \
    const CACHE_T *next_k, const CACHE_T *v, const int64_t token_stride, const int64_t n,      \
    const int64_t octet0, vec (*scores)[SEGMENT_OCTETS]) {                                     \
    const int64_t tile = TILE_TOKENS(group), row_bytes = chunks * LANES * sizeof(CACHE_T);     \
    for (int64_t o = 0; o * LANES < n; o++) {                                                  \
        vec dot[MAX_GROUP][LANES];                                                             \
        for (int64_t j0 = 0; j0 < LANES; j0 += tile) {                                         \
            const int64_t t0 = o * LANES + j0;                                                 \
            const int64_t live = n - t0 < tile ? (n - t0 > 0 ? n - t0 : 0) : tile;             \
            const int64_t step = token_stride * (int64_t)sizeof(CACHE_T); /* bytes a token */  \
            if (next_k) prefetch_rows((const char *)next_k + t0 * step, step, live, row_bytes); \
            prefetch_rows((const char *)v + t0 * step, step, live, row_bytes);                 \
            vec d[MAX_TILE][MAX_GROUP];                                                        \
            for (int64_t i = 0; i < tile; i++)                                                 \
                for (int64_t g = 0; g < group; g++) d[i][g] = (vec){0};                        \
            _Pragma("GCC unroll 32") for (int64_t c = 0; c < chunks; c++) {                  \
                vec kc[MAX_TILE];                                                              \
                if (live == tile) /* the common case: no row checks */                         \
                    for (int64_t i = 0; i < tile; i++)                                         \
                        kc[i] = LOAD(k + (t0 + i) * token_stride + c * LANES);                 \
                else                                                                           \
                    for (int64_t i = 0; i < tile; i++)                                         \
                        kc[i] = i < live ? LOAD(k + (t0 + i) * token_stride + c * LANES)       \
                                         : (vec){0};                                           \
                for (int64_t g = 0; g < group; g++) {                                          \
                    const vec qc = q[g][c];                                                    \
                    for (int64_t i = 0; i < tile; i++) d[i][g] += qc * kc[i];                  \
                }                                                                              \
            }                                                                                  \
            for (int64_t i = 0; i < tile; i++)                                                 \
                for (int64_t g = 0; g < group; g++) dot[g][j0 + i] = d[i][g];                  \
        }                                                                                      \
        for (int64_t g = 0; g < group; g++) scores[g][octet0 + o] = sum8(dot[g]);              \
    }                                                                                          \
}                                                                                              \
static inline __attribute__((always_inline)) void values_##SUFFIX(                             \
    const int64_t group, const int64_t chunks, vec (*acc)[MAX_CHUNKS], const float *correction, \
    const CACHE_T *value_cache, const int32_t *table, const int64_t block_stride,              \
    const int64_t offset, const int64_t token_stride, const int64_t block_size,                \
    const int64_t skip, const int64_t n, vec (*p)[SEGMENT_OCTETS]) {                           \
    for (int64_t g = 0; g < group; g++) {                                                      \
        const float *pg = (const float *)p[g];                                                 \
        for (int64_t c0 = 0; c0 < chunks; c0 += 8) {                                           \
            const int64_t width = chunks - c0 < 8 ? chunks - c0 : 8;                           \
            vec a[8];                                                                          \
            for (int64_t i = 0; i < width; i++) a[i] = acc[g][c0 + i] * correction[g];        \
            for (int64_t start = skip / block_size * block_size; start < n;                    \
                 start += block_size) {                                                        \
                const CACHE_T *v = value_cache                                                 \
                    + (int64_t)table[start / block_size] * block_stride + offset               \
                    + c0 * LANES - start * token_stride;                                       \
                const int64_t end = n - start < block_size ? n : start + block_size;           \
                for (int64_t t = start > skip ? start : skip; t < end; t++)                    \
                    for (int64_t i = 0; i < width; i++)                                        \
                        a[i] += pg[t] * LOAD(v + t * token_stride + i * LANES);                \
            }                                                                                  \
            for (int64_t i = 0; i < width; i++) acc[g][c0 + i] = a[i];                         \
        }                                                                                      \
    }                                                                                          \
}

// The online softmax's step for one query row over a segment's scores `s`: keys outside
// [skip, n) masked out, the new running max, exponentials by vector_exp in place, and the
// row's correction (exp(old max - new max)) for its accumulators and running sum.
static inline void segment_softmax(vec *s, const int64_t skip, const int64_t n,
                                   const float softcap, float *running_max, float *running_sum,
                                   float *correction) {
    ivec lane;
    for (int i = 0; i < LANES; i++) lane[i] = i;
    const int64_t octets = (n + LANES - 1) / LANES;
    vec top = (vec){0} - INFINITY;
    for (int64_t o = 0; o < octets; o++) {
        if (softcap > 0.0f)
            for (int j = 0; j < LANES; j++) s[o][j] = softcap * tanhf(s[o][j] / softcap);
        const ivec at = lane + (int32_t)(o * LANES);
        const ivec live = (at >= (int32_t)skip) & (at < (int32_t)n);
        s[o] = (vec)(((ivec)s[o] & live) | ((ivec)((vec){0} - INFINITY) & ~live));
        top = vmax(s[o], top);
    }
    const float block_max = hmax(top);
    const float new_max = block_max > *running_max ? block_max : *running_max;
    *correction = expf(*running_max - new_max);
    *running_max = new_max;
    vec sum = (vec){0};
    for (int64_t o = 0; o < octets; o++) {
        const ivec at = lane + (int32_t)(o * LANES);
        const ivec live = (at >= (int32_t)skip) & (at < (int32_t)n);
        s[o] = (vec)((ivec)vector_exp(s[o] - new_max) & live);
        sum += s[o];
    }
    *running_sum = *running_sum * *correction + hsum(sum);
}

// One sequence's kv heads [kv_head, kv_head + heads), segment by segment: every head's scores
// block by block (a block's rows, contiguous for all heads, are read once), each query row's
// softmax step, then every head's weighted values. A segment is SEGMENT tokens of whole
// blocks where the block size is a multiple of the lanes (else one block), starting at the
// block that holds the first key in the window. Each query row's arithmetic is the same
// whatever `heads` is, so a row's result does not depend on how the work was split.
#define DEFINE_ATTEND(NAME, SUFFIX, CACHE_T, LOAD)                                             \
static inline __attribute__((always_inline)) void NAME(                                        \
    const int64_t group, const int64_t chunks, const float *query, const CACHE_T *key_cache,   \
    const CACHE_T *value_cache, const int32_t *table, const int64_t seq_len, float *out,       \
    const int64_t token_stride, const int64_t block_stride, const int64_t block_size,          \
    const int64_t kv_head, const int64_t heads, const float scale, const int64_t window,      \
    const float softcap, const float *sinks) {                                                 \
    vec q[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS];                                  \
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], correction[MAX_GROUP];               \
    vec scores[MAX_GROUP][SEGMENT_OCTETS];                                                     \
    const int64_t rows = heads * group, dim = chunks * LANES;                                  \
    for (int64_t r = 0; r < rows; r++) {                                                       \
        for (int64_t c = 0; c < chunks; c++) {                                                 \
            q[r][c] = load_f32(query + r * dim + c * LANES) * scale;                           \
            acc[r][c] = (vec){0};                                                              \
        }                                                                                      \
        running_max[r] = sinks ? sinks[r] : -INFINITY; /* the sink: exp(sink - max) = 1 */    \
        running_sum[r] = sinks ? 1.0f : 0.0f;                                                  \
    }                                                                                          \
    const int64_t first = window < 0 ? (seq_len - 1) / -window * -window                      \
                          : window > 0 && seq_len > window ? seq_len - window : 0;              \
    const int64_t segment = block_size % LANES ? block_size : SEGMENT / block_size * block_size; \
    const int64_t blocks = (seq_len + block_size - 1) / block_size;                            \
    for (int64_t start = first / block_size * block_size; start < seq_len; start += segment) { \
        const int64_t n = seq_len - start < segment ? seq_len - start : segment;               \
        const int64_t skip = first > start ? first - start : 0; /* keys left of the window */  \
        const int32_t *segment_table = table + start / block_size;                             \
        for (int64_t b = 0; b * block_size < n; b++) {                                         \
            const int64_t base = (int64_t)segment_table[b] * block_stride + kv_head * dim;     \
            const int64_t block = start / block_size + b;                                      \
            const int64_t next = block + 1 < blocks                                            \
                ? (int64_t)table[block + 1] * block_stride + kv_head * dim : -1;               \
            const int64_t m = n - b * block_size < block_size ? n - b * block_size : block_size; \
            for (int64_t h = 0; h < heads; h++)                                                \
                scores_##SUFFIX(group, chunks, q + h * group, key_cache + base + h * dim,      \
                                next >= 0 ? key_cache + next + h * dim : 0,                    \
                                value_cache + base + h * dim, token_stride, m,                 \
                                b * block_size / LANES, scores + h * group);                   \
        }                                                                                      \
        for (int64_t r = 0; r < rows; r++)                                                     \
            segment_softmax(scores[r], skip, n, softcap, running_max + r, running_sum + r,     \
                            correction + r);                                                   \
        for (int64_t h = 0; h < heads; h++)                                                    \
            values_##SUFFIX(group, chunks, acc + h * group, correction + h * group,            \
                            value_cache, segment_table, block_stride, (kv_head + h) * dim,     \
                            token_stride, block_size, skip, n, scores + h * group);            \
    }                                                                                          \
    for (int64_t r = 0; r < rows; r++) {                                                       \
        const float inv = running_sum[r] > 0.0f ? 1.0f / running_sum[r] : 0.0f;                \
        for (int64_t c = 0; c < chunks; c++) {                                                 \
            const vec res = acc[r][c] * inv;                                                   \
            memcpy(out + r * dim + c * LANES, &res, sizeof(res));                              \
        }                                                                                      \
    }                                                                                          \
}

#define CASE(ATTEND, G, C)                                                                     \
    if (group == G && chunks == C)                                                             \
        return ATTEND(G, C, query, key_cache, value_cache, table, seq_len, out, token_stride,  \
                      block_stride, block_size, kv_head, heads, scale, window, softcap, sinks);
#define CASES_FOR_GROUP(ATTEND, G)                                                             \
    CASE(ATTEND, G, 8) CASE(ATTEND, G, 16)

// One task with literal sizes for head_dim 64/128 and groups 1-8, runtime sizes for
// anything else. The choice is made per task, inside the OpenMP region:
// an outlined parallel region would otherwise see the sizes as variables again.
#define DEFINE_DISPATCH(NAME, ATTEND, CACHE_T)                                                 \
static void NAME(const int64_t group, const int64_t chunks, const float *query,               \
                 const CACHE_T *key_cache, const CACHE_T *value_cache, const int32_t *table,  \
                 const int64_t seq_len, float *out, const int64_t token_stride,                \
                 const int64_t block_stride, const int64_t block_size, const int64_t kv_head,  \
                 const int64_t heads, const float scale, const int64_t window,                 \
                 const float softcap, const float *sinks) {                                    \
    CASES_FOR_GROUP(ATTEND, 1) CASES_FOR_GROUP(ATTEND, 2) CASES_FOR_GROUP(ATTEND, 3)           \
    CASES_FOR_GROUP(ATTEND, 4) CASES_FOR_GROUP(ATTEND, 5) CASES_FOR_GROUP(ATTEND, 6)           \
    CASES_FOR_GROUP(ATTEND, 7) CASES_FOR_GROUP(ATTEND, 8)                                      \
    ATTEND(group, chunks, query, key_cache, value_cache, table, seq_len, out, token_stride,    \
           block_stride, block_size, kv_head, heads, scale, window, softcap, sinks);           \
}

// The exported entry point: an OpenMP loop over tasks, sequence-major.
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
    /* a task: a sequence's kv heads together (up to MAX_GROUP query rows), unless too few */ \
    /* sequences for the threads: then one kv head a task */                                   \
    const int64_t span = num_seqs >= 4 * num_threads                                           \
        ? (MAX_GROUP / group < num_kv_heads ? MAX_GROUP / group : num_kv_heads) : 1;           \
    const int64_t slabs = (num_kv_heads + span - 1) / span;                                    \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")     \
    for (int64_t seq = 0; seq < num_seqs; seq++) {                                             \
        for (int64_t slab = 0; slab < slabs; slab++) {                                         \
            const int64_t kv_head = slab * span;                                               \
            const int64_t heads = num_kv_heads - kv_head < span ? num_kv_heads - kv_head : span; \
            const int64_t first_head = seq * num_heads + kv_head * group;                      \
            DISPATCH(group, chunks, query + seq * query_stride + kv_head * group * head_dim,   \
                     key_cache, value_cache, block_tables + seq * table_stride,                \
                     seq_lens[seq], out + first_head * head_dim, token_stride, block_stride,   \
                     block_size, kv_head, heads, scale, window, softcap,                       \
                     sinks ? sinks + kv_head * group : 0);                                     \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_SEGMENT_PASSES(f32, float, load_f32)
DEFINE_ATTEND(attend_f32, f32, float, load_f32)
DEFINE_SEGMENT_PASSES(bf16, uint16_t, load_bf16)
DEFINE_ATTEND(attend_bf16, bf16, uint16_t, load_bf16)
DEFINE_DISPATCH(dispatch_f32, attend_f32, float)
DEFINE_DISPATCH(dispatch_bf16, attend_bf16, uint16_t)
DEFINE_DECODE(paged_decode_f32, dispatch_f32, float)
DEFINE_DECODE(paged_decode_bf16, dispatch_bf16, uint16_t)
DEFINE_SEGMENT_PASSES(fp8_e4m3, uint8_t, load_fp8_e4m3)
DEFINE_ATTEND(attend_fp8_e4m3, fp8_e4m3, uint8_t, load_fp8_e4m3)
DEFINE_SEGMENT_PASSES(fp8_e5m2, uint8_t, load_fp8_e5m2)
DEFINE_ATTEND(attend_fp8_e5m2, fp8_e5m2, uint8_t, load_fp8_e5m2)
DEFINE_DISPATCH(dispatch_fp8_e4m3, attend_fp8_e4m3, uint8_t)
DEFINE_DISPATCH(dispatch_fp8_e5m2, attend_fp8_e5m2, uint8_t)
DEFINE_DECODE(paged_decode_fp8_e4m3, dispatch_fp8_e4m3, uint8_t)
DEFINE_DECODE(paged_decode_fp8_e5m2, dispatch_fp8_e5m2, uint8_t)
