// The small per-layer ops of the CPU backend, each one pass over its rows where the torch
// twins (kernels/reference.py) run three to six ops with a temporary each:
//   write_kv      new K/V rows into the paged cache at their slots (skips negative slots)
//   write_kv_fp8  the same into an fp8 cache: each value divided by its layer's scale,
//                 clamped and rounded to e4m3 or e5m2 (fp8.h)
//   rope_neox     rotate-half rotary embedding, in place on the q and k heads of a qkv row
//   add_rms_norm  residual += delta, then out = weight * residual / rms(residual) (also
//                 bf16 rows with a float32 weight: Gemma's); head_rms_norm the same norm
//                 over the heads of a q or k view
//   silu_and_mul  out = silu(gate) * up for the [gate | up] halves of the gate_up matmul;
//                 gelu_tanh_and_mul the same with tanh GELU (Gemma's GeGLU)
// Each comes in float32 (_f32) and bfloat16 (_bf16): bf16 values are widened as they are
// loaded, computed on in float32 and rounded once (to nearest even) as they are stored, so a
// bf16 model pays no separate widening and narrowing copies. Rows are given by pointer and row
// stride (q/k/v are views into one qkv matmul). Why C: a small model's decode step called the
// torch twins ~120 times, each a pass over memory and a dispatch; here each op is one pass.

#include "fp8.h"
#include <immintrin.h>
#include "simd.h"

// Rows are split over OpenMP threads (torch's team: torch.set_num_threads sets it) from this
// many elements up; below, a fork costs more than it saves.
#define PARALLEL_ELEMENTS 16384

// --- loads and stores of eight lanes, and of one element, per dtype ------------------------

static inline void store_f32(float *p, vec v) { memcpy(p, &v, sizeof(v)); }

// Round to nearest even, as torch's float -> bfloat16 does; a NaN stays a (quiet) NaN
// instead of rounding into infinity. AVX512-BF16 does it in one vcvtneps2bf16 (which also
// flushes values under 2^-126 to zero), where by hand it takes several instructions a vector.
static inline void store_bf16(uint16_t *p, vec v) {
#if defined(__AVX512BF16__) && LANES == 16
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
    u32vec bits;
    memcpy(&bits, &v, sizeof(bits));
    const u32vec nan = (u32vec)((bits & 0x7FFFFFFFu) > 0x7F800000u);
    u32vec rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    rounded = (rounded & ~nan) | (((bits >> 16) | 0x40u) & nan);
    const u16vec half = __builtin_convertvector(rounded, u16vec);
    memcpy(p, &half, sizeof(half));
#endif
}

static inline float get_f32(const float *p) { return *p; }
static inline void put_f32(float *p, float x) { *p = x; }

static inline void put_bf16(uint16_t *p, float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
        *p = (uint16_t)((bits >> 16) | 0x40u);
        return;
    }
    *p = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// K and V rows [num_tokens, row] into caches viewed as [num_slots, row], all in bytes (rows
// and strides), so fp32 and bf16 caches take the same copy; slot < 0 is a padding token.
int write_kv(const char *key, const char *value, int64_t key_stride, int64_t value_stride,
             char *key_cache, char *value_cache, const int64_t *slots, int64_t num_tokens,
             int64_t row) {
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(key_cache + slots[t] * row, key + t * key_stride, row);
        memcpy(value_cache + slots[t] * row, value + t * value_stride, row);
    }
    return 0;
}

// One row of `row` values (T, row contiguous) quantised into fp8 bytes: x / scale, then the
// format's clamp and round-to-nearest-even. The tail past the last full vector goes through a
// zero-padded buffer, so every value takes the same conversion.
#define DEFINE_QUANTISE_ROW(NAME, T, LOAD, GET, FORMAT)                                        \
static inline void NAME(const T *x, uint8_t *out, int64_t row, float scale) {                 \
    int64_t i = 0;                                                                             \
    for (; i + LANES <= row; i += LANES) {                                                     \
        const u8vec q = f32_to_##FORMAT(LOAD(x + i) / scale);                                  \
        memcpy(out + i, &q, sizeof(q));                                                        \
    }                                                                                          \
    if (i == row) return;                                                                      \
    float tail[LANES] = {0};                                                                   \
    for (int64_t j = i; j < row; j++) tail[j - i] = GET(x + j);                                \
    const u8vec q = f32_to_##FORMAT(load_f32(tail) / scale);                                   \
    memcpy(out + i, &q, (size_t)(row - i));                                                    \
}

// write_kv for an fp8 cache [num_slots, row] (bytes) from T rows; strides count elements.
#define DEFINE_WRITE_KV_FP8(NAME, T, QUANTISE)                                                 \
int NAME(const T *key, const T *value, int64_t key_stride, int64_t value_stride,              \
         uint8_t *key_cache, uint8_t *value_cache, const int64_t *slots, int64_t num_tokens,  \
         int64_t row, float k_scale, float v_scale) {                                          \
    for (int64_t t = 0; t < num_tokens; t++) {                                                 \
        if (slots[t] < 0) continue;                                                            \
        QUANTISE(key + t * key_stride, key_cache + slots[t] * row, row, k_scale);              \
        QUANTISE(value + t * value_stride, value_cache + slots[t] * row, row, v_scale);        \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_QUANTISE_ROW(quantise_e4m3_f32, float, load_f32, get_f32, fp8_e4m3)
DEFINE_QUANTISE_ROW(quantise_e4m3_bf16, uint16_t, load_bf16, get_bf16, fp8_e4m3)
DEFINE_QUANTISE_ROW(quantise_e5m2_f32, float, load_f32, get_f32, fp8_e5m2)
DEFINE_QUANTISE_ROW(quantise_e5m2_bf16, uint16_t, load_bf16, get_bf16, fp8_e5m2)
DEFINE_WRITE_KV_FP8(write_kv_fp8_e4m3_f32, float, quantise_e4m3_f32)
DEFINE_WRITE_KV_FP8(write_kv_fp8_e4m3_bf16, uint16_t, quantise_e4m3_bf16)
DEFINE_WRITE_KV_FP8(write_kv_fp8_e5m2_f32, float, quantise_e5m2_f32)
DEFINE_WRITE_KV_FP8(write_kv_fp8_e5m2_bf16, uint16_t, quantise_e5m2_bf16)

// Rows of x hold `num_heads` heads of head_dim back to back (q heads then k heads of a qkv
// row); each head's halves (a, b) become (a cos - b sin, b cos + a sin). cos/sin are the
// tokens' rows [num_tokens, head_dim] of the tables engine/model/rope.py builds (half-dim
// angles repeated). The row stride counts elements. LANES of a half at a time, the rest one
// by one (element by element it ran over twice as long).
#define DEFINE_ROPE(NAME, T, LOAD, STORE, GET, PUT)                                            \
int NAME(T *x, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim,   \
         const T *cos_rows, const T *sin_rows) {                                               \
    const int64_t half = head_dim / 2;                                                         \
    _Pragma("omp parallel for if (num_tokens * num_heads * head_dim >= PARALLEL_ELEMENTS)")    \
    for (int64_t t = 0; t < num_tokens; t++) {                                                 \
        const T *cos = cos_rows + t * head_dim, *sin = sin_rows + t * head_dim;                \
        for (int64_t h = 0; h < num_heads; h++) {                                              \
            T *a = x + t * row_stride + h * head_dim, *b = a + half;                           \
            int64_t i = 0;                                                                     \
            for (; i + LANES <= half; i += LANES) {                                            \
                const vec a_i = LOAD(a + i), b_i = LOAD(b + i);                                \
                STORE(a + i, a_i * LOAD(cos + i) - b_i * LOAD(sin + i));                       \
                STORE(b + i, b_i * LOAD(cos + half + i) + a_i * LOAD(sin + half + i));         \
            }                                                                                  \
            for (; i < half; i++) {                                                            \
                const float a_i = GET(a + i), b_i = GET(b + i);                                \
                PUT(a + i, a_i * GET(cos + i) - b_i * GET(sin + i));                           \
                PUT(b + i, b_i * GET(cos + half + i) + a_i * GET(sin + half + i));             \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

static inline float sum_of_lanes(vec v) {  // a fixed pairwise tree: the same order every call
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) v[j] += v[j + width];
    return v[0];
}

// residual [num_tokens, hidden] (contiguous) += delta (NULL: nothing to add; the sum is
// rounded to T as it is stored, and the norm reads the stored sum, as the twin does), then
// out = weight * residual * rsqrt(mean(residual^2) + eps). Sums in float with LANES partial
// sums, as torch's vectorised mean does (not bit-equal to it: ~1e-7 relative). The weight is
// of type W: T, or float beside bf16 rows (Gemma's (1 + w) kept in fp32; the product is in
// float and rounded once either way). LANES at a time, as the rest of the file.
// head_rms_norm: the same norm (no add) over each head of x [num_tokens, heads, head_dim]
// whose tokens are token_stride apart (q or k, a view into a qkv row: Qwen3's and Gemma 3's
// q/k norms) into out [num_tokens, heads, head_dim], contiguous: no gathered copy.
#define DEFINE_RMS_NORMS(SUFFIX, T, LOAD, STORE, GET, PUT, W, LOAD_W, GET_W)                    \
static inline void rms_norm_row_##SUFFIX(const T *x, const W *weight, T *y, int64_t hidden,  \
                                         float eps) {                                          \
    const int64_t full = hidden / LANES * LANES;                                               \
    vec sums = (vec){0};                                                                       \
    for (int64_t i = 0; i < full; i += LANES) {                                                \
        const vec v = LOAD(x + i);                                                             \
        sums += v * v;                                                                         \
    }                                                                                          \
    float total = sum_of_lanes(sums);                                                          \
    for (int64_t i = full; i < hidden; i++) total += GET(x + i) * GET(x + i);                  \
    const float inv_rms = 1.0f / sqrtf(total / (float)hidden + eps);                           \
    for (int64_t k = 0; k < full; k += LANES)                                                  \
        STORE(y + k, LOAD_W(weight + k) * (LOAD(x + k) * inv_rms));                            \
    for (int64_t k = full; k < hidden; k++)                                                    \
        PUT(y + k, GET_W(weight + k) * (GET(x + k) * inv_rms));                                \
}                                                                                              \
int add_rms_norm_##SUFFIX(T *residual, const T *delta, const W *weight, T *out,               \
                          int64_t num_tokens, int64_t hidden, float eps) {                     \
    _Pragma("omp parallel for if (num_tokens * hidden >= PARALLEL_ELEMENTS)")                  \
    for (int64_t t = 0; t < num_tokens; t++) {                                                 \
        T *x = residual + t * hidden;                                                          \
        const int64_t full = hidden / LANES * LANES;                                           \
        if (delta != NULL) {                                                                   \
            const T *d = delta + t * hidden;                                                   \
            for (int64_t i = 0; i < full; i += LANES) STORE(x + i, LOAD(x + i) + LOAD(d + i)); \
            for (int64_t i = full; i < hidden; i++) PUT(x + i, GET(x + i) + GET(d + i));       \
        }                                                                                      \
        rms_norm_row_##SUFFIX(x, weight, out + t * hidden, hidden, eps);                       \
    }                                                                                          \
    return 0;                                                                                  \
}                                                                                              \
int head_rms_norm_##SUFFIX(const T *x, int64_t token_stride, const W *weight, T *out,         \
                           int64_t num_tokens, int64_t num_heads, int64_t head_dim,           \
                           float eps) {                                                        \
    const int64_t rows = num_tokens * num_heads;                                               \
    _Pragma("omp parallel for if (rows * head_dim >= PARALLEL_ELEMENTS)")                      \
    for (int64_t r = 0; r < rows; r++) {                                                       \
        const T *row = x + (r / num_heads) * token_stride + (r % num_heads) * head_dim;        \
        rms_norm_row_##SUFFIX(row, weight, out + r * head_dim, head_dim, eps);                 \
    }                                                                                          \
    return 0;                                                                                  \
}

// gate_up [num_tokens, 2 * inter] (gate half first) -> out [num_tokens, inter]: act(gate) * up
// with act(g) = g / (1 + exp(ARG(g))): SiLU's ARG is -g; GeGLU's tanh GELU is the same form,
// 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)) for y = sqrt(2 / pi) (g + 0.044715 g^3) (no
// 1 - 2 / (exp(2y) + 1) cancellation near 0). At sixteen lanes on AVX-512 hosts: at eight it
// was slower than torch's own twin.
#define SILU_ARG(g) (-(g))
#define GELU_TANH_ARG(g) (-1.5957691216057308f * ((g) + 0.044715f * (g) * (g) * (g)))
#define DEFINE_GATED(NAME, T, LOAD, STORE, GET, PUT, ARG)                                      \
int NAME(const T *gate_up, T *out, int64_t num_tokens, int64_t inter) {                        \
    _Pragma("omp parallel for if (num_tokens * inter >= PARALLEL_ELEMENTS)")                   \
    for (int64_t t = 0; t < num_tokens; t++) {                                                 \
        const T *gate = gate_up + t * 2 * inter, *up = gate + inter;                           \
        T *y = out + t * inter;                                                                \
        int64_t i = 0;                                                                         \
        for (; i + LANES <= inter; i += LANES) {                                               \
            const vec g = LOAD(gate + i);                                                      \
            STORE(y + i, g / (1.0f + vector_exp(ARG(g))) * LOAD(up + i));                      \
        }                                                                                      \
        for (; i < inter; i++) {                                                               \
            const float g = GET(gate + i);                                                     \
            PUT(y + i, g / (1.0f + expf(ARG(g))) * GET(up + i));                               \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_ROPE(rope_neox_f32, float, load_f32, store_f32, get_f32, put_f32)
DEFINE_ROPE(rope_neox_bf16, uint16_t, load_bf16, store_bf16, get_bf16, put_bf16)
DEFINE_RMS_NORMS(f32, float, load_f32, store_f32, get_f32, put_f32, float, load_f32, get_f32)
DEFINE_RMS_NORMS(bf16, uint16_t, load_bf16, store_bf16, get_bf16, put_bf16, uint16_t, load_bf16,
                 get_bf16)
DEFINE_RMS_NORMS(bf16_f32_weight, uint16_t, load_bf16, store_bf16, get_bf16, put_bf16, float,
                 load_f32, get_f32)
DEFINE_GATED(silu_and_mul_f32, float, load_f32, store_f32, get_f32, put_f32, SILU_ARG)
DEFINE_GATED(silu_and_mul_bf16, uint16_t, load_bf16, store_bf16, get_bf16, put_bf16, SILU_ARG)
DEFINE_GATED(gelu_tanh_and_mul_f32, float, load_f32, store_f32, get_f32, put_f32, GELU_TANH_ARG)
DEFINE_GATED(gelu_tanh_and_mul_bf16, uint16_t, load_bf16, store_bf16, get_bf16, put_bf16,
             GELU_TANH_ARG)
