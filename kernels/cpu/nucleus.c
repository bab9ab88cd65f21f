// Sampling float32 logits on the CPU without sorting or summing a whole row in order: top-p
// filtering (top_p_f32) and the inverse-CDF draw that follows every random row (draw_f32).
//
// Top-p (nucleus) filtering of float32 logits without sorting the vocabulary: each row keeps
// the smallest set of its largest logits whose probability mass reaches top_p (the definition:
// kernels/reference.py's top_k_top_p_ref, a row sorted whole), the rest become -inf.
//
// Why: torch's CPU sort of a whole step's vocabulary costs more than the rest of sampling, and
// a small model's nucleus can hold thousands of tokens (SmolLM2 at temperature 1 on random prompts: 62% of rows
// past 64 tokens, their median ~5,500), too many for a topk of candidates. Here a row costs
// four passes: its max, its exps, a histogram of its probability mass by logit
// (BUCKETS_PER_NAT buckets a nat below the max), and the output; only the bucket the boundary
// falls in is sorted (a few hundred values at most).
//
// Ties at the boundary go to the lower index (the sorted twin's order among equal values is
// torch's); the masses are summed in double, so the cut matches the twin's float cumsum except
// where the boundary's running mass is within rounding of top_p.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define BUCKETS_PER_NAT 64
#define BUCKETS 4096  // 64 nats below a row's max; the last bucket takes everything further down

typedef struct {
    float value;
    double probability;
    int64_t index;
} entry;

static int larger_first(const void *a, const void *b) {
    const entry *x = a, *y = b;
    if (x->value != y->value) return x->value > y->value ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

static inline int64_t bucket_of(float x, float max) {
    const float b = (max - x) * BUCKETS_PER_NAT;
    return b < BUCKETS - 1 ? (int64_t)b : BUCKETS - 1;  // -inf lands in the last bucket
}

// the row's largest value (NaN skipped, as each comparison with it is false)
static float row_max(const float *x, int64_t n) {
    vec lanes = (vec){0} - INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vec v = load_f32(x + i);
        lanes = (vec)(((ivec)v & (v > lanes)) | ((ivec)lanes & ~(v > lanes)));
    }
    float m = -INFINITY;
    for (int j = 0; j < LANES; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

// out[i] = exp(x[i] - max) (0 for -inf); returns their sum
static double exps(const float *x, float *out, int64_t n, float max) {
    double total = 0.0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vec v = load_f32(x + i);
        const ivec finite = v > -INFINITY;
        const vec e = (vec)((ivec)vector_exp(v - max) & finite);
        memcpy(out + i, &e, sizeof(e));
        float sum = 0.0f;
        for (int j = 0; j < LANES; j++) sum += e[j];
        total += sum;
    }
    for (; i < n; i++) total += out[i] = x[i] == -INFINITY ? 0.0f : expf(x[i] - max);
    return total;
}

typedef struct {  // a thread's scratch: per bucket its mass and count, per value its bucket
    double mass[BUCKETS];
    int64_t count[BUCKETS];
    uint16_t *bucket;
} scratch;

// one row: out[i] = x[i] where kept, -inf where not (out holds the row's exps meanwhile);
// returns -1 out of memory
static int nucleus_row(const float *x, float *out, int64_t n, float top_p, scratch *t) {
    const float max = row_max(x, n);
    if (max == -INFINITY) {  // nothing to keep
        for (int64_t i = 0; i < n; i++) out[i] = -INFINITY;
        return 0;
    }
    const double inv_total = 1.0 / exps(x, out, n, max);
    memset(t->mass, 0, sizeof(t->mass));
    memset(t->count, 0, sizeof(t->count));
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = t->bucket[i] = (uint16_t)bucket_of(x[i], max);
        t->mass[b] += out[i] * inv_total;
        t->count[b]++;
    }
    int64_t edge = 0;  // the bucket the cut falls in, and the mass of the buckets above it
    double before = 0.0;
    while (edge < BUCKETS - 1 && before + t->mass[edge] < top_p) before += t->mass[edge++];
    entry *inside = malloc((t->count[edge] ? t->count[edge] : 1) * sizeof(entry));
    if (!inside) return -1;
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        if (t->bucket[i] == edge) inside[count++] = (entry){x[i], out[i] * inv_total, i};
        out[i] = t->bucket[i] < edge ? x[i] : -INFINITY;
    }
    qsort(inside, count, sizeof(entry), larger_first);
    for (int64_t j = 0; j < count && before < top_p; j++) {  // kept while the mass before < top_p
        out[inside[j].index] = inside[j].value;
        before += inside[j].probability;
    }
    free(inside);
    return 0;
}

// logits, out [rows, vocab] (rows `stride` apart), top_p [rows], each in (0, 1)
int top_p_f32(const float *logits, float *out, const float *top_p, int64_t rows, int64_t vocab,
              int64_t stride) {
    int status = 0;
#pragma omp parallel
    {
        scratch *t = malloc(sizeof(scratch));
        uint16_t *buckets = malloc((vocab ? vocab : 1) * sizeof(uint16_t));
        if (t) t->bucket = buckets;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (!t || !buckets ||
                nucleus_row(logits + r * stride, out + r * stride, vocab, top_p[r], t))
                status = -1;
        free(buckets);
        free(t);
    }
    return status;
}

// The draw: a row's token is the first whose running probability mass passes u times the
// row's total (kernels/reference.py's draw_ref: softmax, cumsum, searchsorted), so token i with
// probability p[i] and a zero-probability (-inf) token never. The row's exps are summed in
// blocks of DRAW_BLOCK (double), u's block is found among the block sums, and only that block
// is walked token by token. torch's CPU cumsum ran one row after another, ~1 ns a logit: 3 ms
// of a 64-row SmolLM2 decode step's ~7 ms of sampling, with the softmax and the division by
// the temperature (benchmarks/reports/2026-12-07-xeon-amx-decode-overheads/); here a row costs
// a max and a pass of exps. The masses differ from the twin's float cumsum by rounding only, so
// the two draw the same token except where u falls within rounding of a boundary.
#define DRAW_BLOCK 256

// exp((x[i] - max) * inv_t) over [from, to), into out where not NULL: 0 for -inf; returns
// their sum (lanes summed apart, then together: one add chain per element ran 4x slower)
static double scaled_exps(const float *x, int64_t from, int64_t to, float max, float inv_t,
                          float *out) {
    vec lanes = (vec){0};
    int64_t i = from;
    for (; i + LANES <= to; i += LANES) {
        const vec v = load_f32(x + i);
        const ivec finite = v > -INFINITY;
        const vec e = (vec)((ivec)exp_fast((v - max) * inv_t) & finite);
        if (out) memcpy(out + i - from, &e, sizeof(e));
        lanes += e;
    }
    double total = 0.0;
    for (int j = 0; j < LANES; j++) total += lanes[j];
    for (; i < to; i++) {
        const float e = x[i] == -INFINITY ? 0.0f : expf((x[i] - max) * inv_t);
        if (out) out[i - from] = e;
        total += e;
    }
    return total;
}

static inline int64_t block_end(int64_t b, int64_t n) {  // DRAW_BLOCK b's end in a row of n
    return (b + 1) * DRAW_BLOCK < n ? (b + 1) * DRAW_BLOCK : n;
}

// one row's token; `mass` has room for a sum per DRAW_BLOCK logits
static int64_t draw_row(const float *x, int64_t n, float inv_t, float u, double *mass) {
    const float max = row_max(x, n);
    if (max == -INFINITY) return n - 1;  // no mass at all: the twin's clamp to the last index
    const int64_t blocks = (n + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        total += mass[b] = scaled_exps(x, b * DRAW_BLOCK, block_end(b, n), max, inv_t, 0);
    }
    const double target = (double)u * total;
    double before = 0.0;  // the mass of the blocks before b
    int64_t b = 0, found = 0;  // found: the last block with mass so far (the max's has some)
    for (; b < blocks; b++) {
        if (mass[b] <= 0.0) continue;
        found = b;
        if (before + mass[b] > target) break;
        before += mass[b];
    }
    if (b == blocks) before -= mass[b = found];  // u within rounding of 1: the last block
    const int64_t start = b * DRAW_BLOCK, end = block_end(b, n);
    float e[DRAW_BLOCK];
    scaled_exps(x, start, end, max, inv_t, e);
    int64_t last = start;
    for (int64_t i = start; i < end; i++) {
        if (e[i - start] <= 0.0f) continue;
        last = i;
        before += e[i - start];
        if (before > target) return i;
    }
    return last;  // the block's sum passed target, its walk summed a hair less: its last token
}

// bf16 rows (exactly float32's top halves), in place of a float copy of the whole step's
static void widen_row(const uint16_t *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vec v = load_bf16(x + i);
        memcpy(out + i, &v, sizeof(v));
    }
    for (; i < n; i++) out[i] = get_bf16(x + i);
}

// the draw of every row of float32 `f32` or, where it is NULL, of bf16 `bf16`: each bf16 row
// widened into the thread's buffer (a row, in L2) and drawn from there, so a bf16 model's
// sampling writes and reads no float copy of its logits; 0, or -1 out of memory
static int draw_rows(const float *f32, const uint16_t *bf16, const float *inv_temperature,
                     const float *u, int64_t *out, int64_t rows, int64_t vocab, int64_t stride) {
    int status = 0;
#pragma omp parallel
    {
        double *mass = malloc(((vocab + DRAW_BLOCK - 1) / DRAW_BLOCK + 1) * sizeof(double));
        float *row = f32 ? NULL : malloc((vocab ? vocab : 1) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!mass || (!f32 && !row)) {
                status = -1;
                continue;
            }
            if (!f32) widen_row(bf16 + r * stride, row, vocab);
            const float *x = f32 ? f32 + r * stride : row;
            out[r] = draw_row(x, vocab, inv_temperature[r], u[r], mass);
        }
        free(row);
        free(mass);
    }
    return status;
}

// logits [rows, vocab] (rows `stride` apart), inv_temperature and u [rows] (u in [0, 1)),
// out int64 [rows]; 0, or -1 out of memory
int draw_f32(const float *logits, const float *inv_temperature, const float *u, int64_t *out,
             int64_t rows, int64_t vocab, int64_t stride) {
    return draw_rows(logits, NULL, inv_temperature, u, out, rows, vocab, stride);
}

int draw_bf16(const uint16_t *logits, const float *inv_temperature, const float *u,
              int64_t *out, int64_t rows, int64_t vocab, int64_t stride) {
    return draw_rows(NULL, logits, inv_temperature, u, out, rows, vocab, stride);
}
