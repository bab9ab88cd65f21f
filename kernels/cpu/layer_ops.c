// The small per-layer ops of the CPU backend, each one pass over its rows where the torch
// twins (kernels/reference.py) run three to six ops with a temporary each:
//   write_kv      new K/V rows into the paged cache at their slots (skips negative slots)
//   rope_neox     rotate-half rotary embedding, in place on the q and k heads of a qkv row
//   add_rms_norm  residual += delta, then out = weight * residual / rms(residual)
//   silu_and_mul  out = silu(gate) * up for the [gate | up] halves of the gate_up matmul
// float32 only, rows given by pointer and row stride (q/k/v are views into one qkv matmul).
// A SmolLM2 decode step of 64 tokens called the twins 120 times for ~25 ms in all.

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8
// Rows are split over OpenMP threads (torch's team: torch.set_num_threads sets it) from this
// many elements up; below, a fork costs more than it saves.
#define PARALLEL_ELEMENTS 16384
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline vec clamp(vec x, float lo, float hi) {
    const ivec low = x < lo, high = x > hi;
    const ivec lo_bits = (ivec)((vec){0} + lo), hi_bits = (ivec)((vec){0} + hi);
    return (vec)(((ivec)x & ~(low | high)) | (lo_bits & low) | (hi_bits & high));
}

// exp on eight lanes, Cephes' expf (within 2 ulp); inputs clamped to [-87.3, 88.3], where
// the result stays a normal float
static inline vec vector_exp(vec x) {
    x = clamp(x, -87.3f, 88.3f);
    const vec fx = x * 1.44269504088896341f + 0.5f;
    ivec n = __builtin_convertvector(fx, ivec);  // truncates toward zero: floor needs a fix
    n += __builtin_convertvector(n, vec) > fx;   // true is -1
    const vec nf = __builtin_convertvector(n, vec);
    x = x - nf * 0.693359375f - nf * -2.12194440e-4f;
    vec y = 1.9875691500e-4f * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    return y * (vec)((n + 127) << 23);
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

// Rows of x hold `num_heads` heads of head_dim back to back (q heads then k heads of a qkv
// row); each head's halves (a, b) become (a cos - b sin, b cos + a sin). cos/sin are the
// tokens' rows [num_tokens, head_dim] of the tables engine/model/rope.py builds (half-dim
// angles repeated).
int rope_neox(float *x, int64_t row_stride, int64_t num_tokens, int64_t num_heads,
              int64_t head_dim, const float *cos_rows, const float *sin_rows) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *cos = cos_rows + t * head_dim, *sin = sin_rows + t * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *a = x + t * row_stride + h * head_dim, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                const float a_i = a[i], b_i = b[i];
                a[i] = a_i * cos[i] - b_i * sin[i];
                b[i] = b_i * cos[half + i] + a_i * sin[half + i];
            }
        }
    }
    return 0;
}

// residual [num_tokens, hidden] (contiguous) += delta (NULL: nothing to add), then
// out = weight * residual * rsqrt(mean(residual^2) + eps). Sums in float with eight partial
// sums, as torch's vectorised mean does (not bit-equal to it: ~1e-7 relative).
int add_rms_norm(float *residual, const float *delta, const float *weight, float *out,
                  int64_t num_tokens, int64_t hidden, float eps) {
#pragma omp parallel for if (num_tokens * hidden >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        float *x = residual + t * hidden;
        float sums[8] = {0};
        if (delta != NULL) {
            const float *d = delta + t * hidden;
            for (int64_t i = 0; i < hidden; i++) x[i] += d[i];
        }
        int64_t i = 0;
        for (; i + 8 <= hidden; i += 8)
            for (int j = 0; j < 8; j++) sums[j] += x[i + j] * x[i + j];
        for (; i < hidden; i++) sums[0] += x[i] * x[i];
        const float total = ((sums[0] + sums[1]) + (sums[2] + sums[3])) +
                            ((sums[4] + sums[5]) + (sums[6] + sums[7]));
        const float inv_rms = 1.0f / sqrtf(total / (float)hidden + eps);
        float *y = out + t * hidden;
        for (int64_t k = 0; k < hidden; k++) y[k] = weight[k] * (x[k] * inv_rms);
    }
    return 0;
}

// gate_up [num_tokens, 2 * inter] (gate half first) -> out [num_tokens, inter]
int silu_and_mul(const float *gate_up, float *out, int64_t num_tokens, int64_t inter) {
#pragma omp parallel for if (num_tokens * inter >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *gate = gate_up + t * 2 * inter, *up = gate + inter;
        float *y = out + t * inter;
        int64_t i = 0;
        for (; i + LANES <= inter; i += LANES) {
            const vec g = load(gate + i);
            const vec r = g / (1.0f + vector_exp(-g)) * load(up + i);
            memcpy(y + i, &r, sizeof(r));
        }
        for (; i < inter; i++) y[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    return 0;
}
