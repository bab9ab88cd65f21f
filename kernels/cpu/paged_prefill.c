// Paged attention of prefill chunks on CPUs, over the token-major cache, read in place through
// the block tables: flash-style, one query tile by one step of keys at a time, with an online
// softmax, in fp32 arithmetic over fp32, bf16 or fp8 (e4m3 / e5m2) pages. The contract of
// kernels/reference.py's chunk_attention_ref for the chunks of `min_q_len` tokens or more of a
// varlen batch (shorter ones and decode tokens are the decode kernel's, paged_decode.c).
//
// Why: the torch path gathers each sequence's whole context into a contiguous copy (and widens
// bf16 / fp8 pages) before SDPA, writing and reading the context again for every chunk and
// layer. Here each step's keys are read in place once per query tile (fp32 pages straight from
// the cache, bf16 / fp8 ones widened into a small buffer that stays in L1/L2), and the
// products are register-blocked FMAs: a GEMM micro-kernel.
//
// Layouts (the engine's, see kernels/reference.py):
//   query  [num_tokens, num_heads, head_dim]                  float32, rows query_stride apart
//   cache  [num_blocks, block_size, num_kv_heads, head_dim]   float32 / bfloat16 / fp8 bytes
//   block_tables int32 [num_seqs, table_stride], cu_seqlens_q int32 [num_seqs + 1],
//   seq_lens int32 [num_seqs] (the context including the chunk)
//   out    [num_tokens, num_heads, head_dim]                   float32; only the rows of the
//                                                              chunks taken are written
// A unit of work is one kv head and up to ROWS query rows of one chunk: a run of tokens, each
// with its group of query heads (GQA: a key row is read once for the whole group). Per step of
// KEYS keys (gathered through the block table into fp32 rows): S^T = K Q^T (`scores`: the query
// tile is transposed once per unit, so the keys are broadcast from their rows and a vector
// holds one key's scores for LANES query rows), the causal / window / chunk masks, soft-capping
// and the online softmax with rows in lanes (`softmax_step`: no horizontal reductions), then
// O += P V (`accumulate`). Units go to OpenMP threads dynamically, the longest (the last tiles
// of a causal chunk) first.
// `window` > 0: a query at position p sees keys p - window < j <= p; < 0: the keys of its chunk
// of -window tokens (Llama 4). `softcap` > 0 maps a score s to softcap * tanh(s / softcap).
// `sinks` (NULL: none): a logit per query head joining each softmax's denominator. An fp8
// cache's scales are the caller's (k_scale folded into `scale`, v_scale on the output).
// Returns 0, or -1 for inputs it does not take (head_dim not a multiple of the lanes or over
// MAX_DIM, a group over MAX_ROWS, a chunk longer than its context): the caller's twin answers.

#include <omp.h>
#include <stdlib.h>

#include "fp8.h"
#include "simd.h"

#define ROWS 48           // query rows a unit aims at (tokens x group)
#define MAX_ROWS 64
#define KEYS 64           // keys a step
#define MAX_DIM 256
#if LANES == 16  // 32 registers: 8 keys x 3 row vectors of accumulators
#define KEY_TILE 8
#else
#define KEY_TILE 4        // keys of a register block of scores
#endif
#define ROW_TILE 4        // rows of a register block of outputs
#define NO_SCORE -1e30f   // a row's running max before any key: finite, so m - m is 0
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *query;
    const void *key_cache, *value_cache;
    const int32_t *block_tables, *cu_seqlens_q, *seq_lens;
    float *out;
    const float *sinks;
    int64_t query_stride, table_stride, num_heads, num_kv_heads, head_dim, block_size, group;
    float scale, softcap;
    int64_t window;
} shape;

typedef struct {
    int32_t seq, kv_head, first_token, tokens;
} unit;

typedef struct {  // one thread's buffers (64-byte aligned); rows: a multiple of LANES
    float *qt;    // [head_dim][rows]  the scaled queries, transposed
    float *o;     // [rows][head_dim]  the unnormalised outputs
    float *p;     // [KEYS][rows]      a step's scores, then its weights
    float *k, *v; // [KEYS][head_dim]  a step's keys and values widened to fp32
    float *zero;  // [head_dim]        the row of the keys past the step's end
    const float *key_rows[KEYS], *value_rows[KEYS];  // a step's rows: cache or k / v
    float *m, *l; // [rows]            running max and sum
    int32_t *q_pos, *first;  // [rows] each row's position and its first visible key
    int64_t rows;
} workspace;

// Points key_rows / value_rows at the fp32 rows of keys k0..k0+n: in the cache itself for
// fp32 pages (no copy), else widened into k / v; the rows past n at zeros (0 x garbage
// could be NaN).
typedef void (*pack_fn)(const shape *s, const int32_t *table, int64_t kv_head, int64_t k0,
                        int64_t n, workspace *w);

static inline int64_t cache_row(const shape *s, const int32_t *table, int64_t kv_head,
                                int64_t pos) {
    return ((int64_t)table[pos / s->block_size] * s->block_size + pos % s->block_size)
           * s->num_kv_heads * s->head_dim + kv_head * s->head_dim;
}

static void pack_f32(const shape *s, const int32_t *table, int64_t kv_head, int64_t k0,
                     int64_t n, workspace *w) {
    for (int64_t j = 0; j < KEYS; j++) {
        const int64_t row = j < n ? cache_row(s, table, kv_head, k0 + j) : 0;
        w->key_rows[j] = j < n ? (const float *)s->key_cache + row : w->zero;
        w->value_rows[j] = j < n ? (const float *)s->value_cache + row : w->zero;
    }
}

#define DEFINE_PACK(NAME, CACHE_T, LOAD)                                                       \
static void NAME(const shape *s, const int32_t *table, int64_t kv_head, int64_t k0, int64_t n, \
                 workspace *w) {                                                               \
    const int64_t dim = s->head_dim;                                                           \
    for (int64_t j = 0; j < KEYS; j++) {                                                       \
        w->key_rows[j] = j < n ? w->k + j * dim : w->zero;                                     \
        w->value_rows[j] = j < n ? w->v + j * dim : w->zero;                                   \
        if (j >= n) continue;                                                                  \
        const int64_t row = cache_row(s, table, kv_head, k0 + j);                              \
        for (int64_t c = 0; c < dim; c += LANES) {                                             \
            const vec kc = LOAD((const CACHE_T *)s->key_cache + row + c);                      \
            const vec vc = LOAD((const CACHE_T *)s->value_cache + row + c);                    \
            memcpy(w->k + j * dim + c, &kc, sizeof(kc));                                       \
            memcpy(w->v + j * dim + c, &vc, sizeof(vc));                                       \
        }                                                                                      \
    }                                                                                          \
}

DEFINE_PACK(pack_bf16, uint16_t, load_bf16)
DEFINE_PACK(pack_fp8_e4m3, uint8_t, load_fp8_e4m3)
DEFINE_PACK(pack_fp8_e5m2, uint8_t, load_fp8_e5m2)

static inline vec broadcast(float x) { return (vec){0} + x; }

// p [KEY_TILE keys from j0][width row vectors from c] = k . qt, in registers
INLINE void score_tile(const workspace *w, int64_t dim, int64_t j0, int64_t c, const int width) {
    vec acc[KEY_TILE][3] = {{{0}}};
    for (int64_t d = 0; d < dim; d++) {
        vec q[3];
        for (int x = 0; x < width; x++) q[x] = load_f32(w->qt + d * w->rows + c + x * LANES);
        for (int i = 0; i < KEY_TILE; i++) {
            const vec kb = broadcast(w->key_rows[j0 + i][d]);
            for (int x = 0; x < width; x++) acc[i][x] += kb * q[x];
        }
    }
    for (int i = 0; i < KEY_TILE; i++)
        for (int x = 0; x < width; x++)
            memcpy(w->p + (j0 + i) * w->rows + c + x * LANES, &acc[i][x], sizeof(vec));
}

// S^T [n keys][rows] = K Q^T, three row vectors at a time
static void scores(const workspace *w, int64_t dim, int64_t n) {
    for (int64_t j0 = 0; j0 < n; j0 += KEY_TILE) {
        int64_t c = 0;
        for (; c + 3 * LANES <= w->rows; c += 3 * LANES) score_tile(w, dim, j0, c, 3);
        for (; c + 2 * LANES <= w->rows; c += 2 * LANES) score_tile(w, dim, j0, c, 2);
        for (; c < w->rows; c += LANES) score_tile(w, dim, j0, c, 1);
    }
}

// o [ROW_TILE rows from r0][width vectors from c] += p^T . v over n keys, width 4 or 1
INLINE void accumulate_tile(const workspace *w, int64_t dim, int64_t n, int64_t r0, int64_t c,
                            const int width) {
    vec acc[ROW_TILE][4];
    for (int i = 0; i < ROW_TILE; i++)
        for (int x = 0; x < width; x++) acc[i][x] = load_f32(w->o + (r0 + i) * dim + c + x * LANES);
    for (int64_t j = 0; j < n; j++) {
        vec vv[4];
        for (int x = 0; x < width; x++) vv[x] = load_f32(w->value_rows[j] + c + x * LANES);
        for (int i = 0; i < ROW_TILE; i++) {
            const vec pb = broadcast(w->p[j * w->rows + r0 + i]);
            for (int x = 0; x < width; x++) acc[i][x] += pb * vv[x];
        }
    }
    for (int i = 0; i < ROW_TILE; i++)
        for (int x = 0; x < width; x++)
            memcpy(w->o + (r0 + i) * dim + c + x * LANES, &acc[i][x], sizeof(vec));
}

static void accumulate(const workspace *w, int64_t dim, int64_t n) {
    for (int64_t r0 = 0; r0 < w->rows; r0 += ROW_TILE) {
        int64_t c = 0;
        for (; c + 4 * LANES <= dim; c += 4 * LANES) accumulate_tile(w, dim, n, r0, c, 4);
        for (; c < dim; c += LANES) accumulate_tile(w, dim, n, r0, c, 1);
    }
}

// One step's scores (keys k0..k0+n) soft-capped, masked and exponentiated in place, rows in
// lanes; each row's running max and sum updated and its output row rescaled.
static void softmax_step(const shape *s, workspace *w, int64_t k0, int64_t n) {
    for (int64_t c = 0; c < w->rows; c += LANES) {
        ivec q_pos, first;
        memcpy(&q_pos, w->q_pos + c, sizeof(q_pos));
        memcpy(&first, w->first + c, sizeof(first));
        const vec m_old = load_f32(w->m + c);
        vec top = m_old;
        for (int64_t j = 0; j < n; j++) {
            float *row = w->p + j * w->rows + c;
            vec x = load_f32(row);
            if (s->softcap > 0.0f)
                for (int lane = 0; lane < LANES; lane++) x[lane] = s->softcap * tanhf(x[lane] / s->softcap);
            const int32_t pos = (int32_t)(k0 + j);
            const ivec keep = (pos <= q_pos) & (pos >= first);
            x = (vec)(((ivec)x & keep) | ((ivec)broadcast(NO_SCORE) & ~keep));
            const ivec higher = x > top;
            top = (vec)(((ivec)x & higher) | ((ivec)top & ~higher));
            memcpy(row, &x, sizeof(x));
        }
        vec sum = (vec){0};
        for (int64_t j = 0; j < n; j++) {
            float *row = w->p + j * w->rows + c;
            const vec x = load_f32(row);
            const vec e = (vec)((ivec)vector_exp(x - top) & (x > NO_SCORE));  // hidden: 0
            sum += e;
            memcpy(row, &e, sizeof(e));
        }
        const vec correction = vector_exp(m_old - top);
        const vec l = load_f32(w->l + c) * correction + sum;
        memcpy(w->l + c, &l, sizeof(l));
        memcpy(w->m + c, &top, sizeof(top));
        for (int lane = 0; lane < LANES; lane++)
            if (correction[lane] != 1.0f)
                for (int64_t d = 0; d < s->head_dim; d++) w->o[(c + lane) * s->head_dim + d] *= correction[lane];
    }
}

static int64_t first_visible(const shape *s, int64_t q_pos) {
    if (s->window > 0) return q_pos - s->window + 1 > 0 ? q_pos - s->window + 1 : 0;
    if (s->window < 0) return q_pos - q_pos % -s->window;
    return 0;
}

// The unit's query rows (scaled, transposed), positions, running state and zeroed output;
// padding rows (up to a multiple of LANES) see no key.
static void load_unit(const shape *s, const unit *u, workspace *w) {
    const int64_t dim = s->head_dim, group = s->group;
    const int64_t q_len = s->cu_seqlens_q[u->seq + 1] - s->cu_seqlens_q[u->seq];
    const int64_t rows = u->tokens * group;
    w->rows = (rows + LANES - 1) / LANES * LANES;
    for (int64_t r = 0; r < w->rows; r++) {
        const int64_t token = u->first_token + r / group, head = u->kv_head * group + r % group;
        const int real = r < rows;
        w->q_pos[r] = real ? s->seq_lens[u->seq] - q_len + token : -1;
        w->first[r] = real ? first_visible(s, w->q_pos[r]) : 0;
        w->m[r] = real && s->sinks ? s->sinks[head] : NO_SCORE;
        w->l[r] = real && s->sinks ? 1.0f : 0.0f;  // the sink: exp(sink - max) = 1
        const float *q = s->query + (s->cu_seqlens_q[u->seq] + token) * s->query_stride + head * dim;
        for (int64_t d = 0; d < dim; d++) {
            w->qt[d * w->rows + r] = real ? q[d] * s->scale : 0.0f;
            w->o[r * dim + d] = 0.0f;
        }
    }
}

static void store_unit(const shape *s, const unit *u, const workspace *w) {
    const int64_t dim = s->head_dim, group = s->group;
    for (int64_t r = 0; r < u->tokens * group; r++) {
        const int64_t token = s->cu_seqlens_q[u->seq] + u->first_token + r / group;
        float *out = s->out + (token * s->num_heads + u->kv_head * group + r % group) * dim;
        const float inv = w->l[r] > 0.0f ? 1.0f / w->l[r] : 0.0f;
        for (int64_t d = 0; d < dim; d++) out[d] = w->o[r * dim + d] * inv;
    }
}

static void attend_unit(const shape *s, const unit *u, workspace *w, pack_fn pack) {
    load_unit(s, u, w);
    const int64_t start = w->first[0], end = w->q_pos[u->tokens * s->group - 1] + 1;
    const int32_t *table = s->block_tables + u->seq * s->table_stride;
    for (int64_t k0 = start; k0 < end; k0 += KEYS) {
        const int64_t n = end - k0 < KEYS ? end - k0 : KEYS;
        pack(s, table, u->kv_head, k0, n, w);
        scores(w, s->head_dim, (n + KEY_TILE - 1) / KEY_TILE * KEY_TILE);
        softmax_step(s, w, k0, n);
        accumulate(w, s->head_dim, n);
    }
    store_unit(s, u, w);
}

// The units of every chunk of min_q_len tokens or more, each chunk's last tile first; NULL
// with *count -1 for a chunk longer than its context.
static unit *make_units(const shape *s, int64_t num_seqs, int64_t min_q_len, int64_t *count) {
    const int64_t tokens = ROWS / s->group > 0 ? ROWS / s->group : 1;
    int64_t total = 0;
    for (int64_t seq = 0; seq < num_seqs; seq++) {
        const int64_t q_len = s->cu_seqlens_q[seq + 1] - s->cu_seqlens_q[seq];
        if (q_len < 0 || q_len > s->seq_lens[seq]) return *count = -1, NULL;
        if (q_len >= min_q_len && q_len > 0) total += (q_len + tokens - 1) / tokens * s->num_kv_heads;
    }
    unit *units = malloc((total > 0 ? total : 1) * sizeof(unit));
    int64_t n = 0;
    for (int64_t seq = 0; seq < num_seqs; seq++) {
        const int64_t q_len = s->cu_seqlens_q[seq + 1] - s->cu_seqlens_q[seq];
        if (q_len < min_q_len || q_len == 0) continue;
        for (int64_t t = (q_len - 1) / tokens * tokens; t >= 0; t -= tokens)
            for (int64_t h = 0; h < s->num_kv_heads; h++)
                units[n++] = (unit){seq, h, t, q_len - t < tokens ? q_len - t : tokens};
    }
    *count = n;
    return units;
}

static workspace workspace_for(const shape *s) {
    const int64_t dim = s->head_dim;
    const size_t floats = 2 * MAX_ROWS * dim + MAX_ROWS * KEYS + 2 * KEYS * dim + 4 * MAX_ROWS + dim;
    workspace w = {.qt = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64)};
    w.o = w.qt + MAX_ROWS * dim;
    w.p = w.o + MAX_ROWS * dim;
    w.k = w.p + MAX_ROWS * KEYS;
    w.v = w.k + KEYS * dim;
    w.m = w.v + KEYS * dim;
    w.l = w.m + MAX_ROWS;
    w.q_pos = (int32_t *)(w.l + MAX_ROWS);
    w.first = w.q_pos + MAX_ROWS;
    w.zero = (float *)(w.first + MAX_ROWS);
    memset(w.zero, 0, dim * sizeof(float));
    return w;
}

static int run(shape *s, int64_t num_seqs, int64_t min_q_len, int64_t num_threads, pack_fn pack) {
    if (s->num_kv_heads < 1 || s->num_heads % s->num_kv_heads) return -1;
    s->group = s->num_heads / s->num_kv_heads;
    if (s->head_dim % LANES || s->head_dim > MAX_DIM || s->group > MAX_ROWS) return -1;
    int64_t count;
    unit *units = make_units(s, num_seqs, min_q_len, &count);
    if (count < 0) return -1;
#pragma omp parallel num_threads(num_threads) if (count > 1)
    {
        workspace w = workspace_for(s);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++) attend_unit(s, &units[i], &w, pack);
        free(w.qt);
    }
    free(units);
    return 0;
}

#define DEFINE_PREFILL(NAME, PACK)                                                             \
int NAME(const float *query, int64_t query_stride, const void *key_cache,                      \
         const void *value_cache, const int32_t *block_tables, int64_t table_stride,           \
         const int32_t *cu_seqlens_q, const int32_t *seq_lens, float *out, int64_t num_seqs,   \
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,        \
         int64_t num_threads, float scale, int64_t window, float softcap, const float *sinks,  \
         int64_t min_q_len) {                                                                  \
    shape s = {.query = query, .key_cache = key_cache, .value_cache = value_cache,             \
               .block_tables = block_tables, .cu_seqlens_q = cu_seqlens_q,                     \
               .seq_lens = seq_lens, .out = out, .sinks = sinks, .query_stride = query_stride, \
               .table_stride = table_stride, .num_heads = num_heads,                           \
               .num_kv_heads = num_kv_heads, .head_dim = head_dim, .block_size = block_size,   \
               .scale = scale, .softcap = softcap, .window = window};                          \
    return run(&s, num_seqs, min_q_len, num_threads, PACK);                                    \
}

DEFINE_PREFILL(paged_prefill_f32, pack_f32)
DEFINE_PREFILL(paged_prefill_bf16, pack_bf16)
DEFINE_PREFILL(paged_prefill_fp8_e4m3, pack_fp8_e4m3)
DEFINE_PREFILL(paged_prefill_fp8_e5m2, pack_fp8_e5m2)

// The lanes of a vector in this build: head_dim must be a multiple of them.
int prefill_lanes(void) { return LANES; }
