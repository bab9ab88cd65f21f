// Mamba2's decode step on the CPU: one token for each of S sequences, each on its own state
// slot, the SSM state updated in place (fp32 maths; the state stored fp32 or bf16):
//   h = exp(dt * A) h + (dt x) ⊗ B;   y = h · C + D x
// per (sequence, head), the state rows [head_dim, d_state] streamed once: read, updated,
// dotted with C and written back in one pass (the torch twin, kernels/mamba2_scan.py's
// ssm_step_slots_ref, gathers, computes in temporaries and scatters). Loaded by
// kernels/cpu_mamba2.py; x, dt, A, B, C and D come in fp32, B and C [S, groups, d_state].
#include "simd.h"

static inline float hsum(vec v) {
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += v[i];
    return total;
}

static inline vec load_state_f32(const float *p) { return load_f32(p); }
static inline void store_state_f32(float *p, vec v) { memcpy(p, &v, sizeof(v)); }
static inline float scalar_f32(const float *p) { return *p; }
static inline void put_f32(float *p, float v) { *p = v; }

static inline vec load_state_bf16(const uint16_t *p) { return load_bf16(p); }
// round to nearest even, as torch's float -> bf16
static inline void store_state_bf16(uint16_t *p, vec v) {
    u32vec bits;
    memcpy(&bits, &v, sizeof(v));
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const u16vec half = __builtin_convertvector(bits, u16vec);
    memcpy(p, &half, sizeof(half));
}
static inline float scalar_bf16(const uint16_t *p) { return get_bf16(p); }  // DEFINE_STEP's name
static inline void put_bf16(uint16_t *p, float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof(bits));
    *p = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#define DEFINE_STEP(NAME, STATE_T, SUFFIX)                                                     \
    int NAME(const float *x, const float *dt, const float *A, const float *B, const float *C, \
             const float *D, STATE_T *states, const int64_t *slots, float *out,               \
             int64_t num_seqs, int64_t heads, int64_t groups, int64_t head_dim,                \
             int64_t state_size, int64_t num_threads) {                                        \
        const int64_t per_group = heads / groups, vec_end = state_size / LANES * LANES;        \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(num_threads)")     \
        for (int64_t s = 0; s < num_seqs; s++) {                                               \
            for (int64_t h = 0; h < heads; h++) {                                              \
                const float step = dt[s * heads + h], decay = expf(step * A[h]);              \
                const float *b = B + (s * groups + h / per_group) * state_size;               \
                const float *c = C + (s * groups + h / per_group) * state_size;               \
                const float *xs = x + (s * heads + h) * head_dim;                              \
                STATE_T *rows = states + (slots[s] * heads + h) * head_dim * state_size;      \
                for (int64_t p = 0; p < head_dim; p++) {                                       \
                    STATE_T *row = rows + p * state_size;                                      \
                    const float write = step * xs[p];                                          \
                    vec acc = {0};                                                             \
                    for (int64_t n = 0; n < vec_end; n += LANES) {                             \
                        const vec next = decay * load_state_##SUFFIX(row + n) +               \
                                         write * load_f32(b + n);                              \
                        store_state_##SUFFIX(row + n, next);                                   \
                        acc += next * load_f32(c + n);                                         \
                    }                                                                          \
                    float total = hsum(acc);                                                   \
                    for (int64_t n = vec_end; n < state_size; n++) {                           \
                        const float next = decay * scalar_##SUFFIX(row + n) + write * b[n];   \
                        put_##SUFFIX(row + n, next);                                           \
                        total += next * c[n];                                                  \
                    }                                                                          \
                    out[(s * heads + h) * head_dim + p] = total + D[h] * xs[p];                \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_STEP(mamba2_step_f32, float, f32)
DEFINE_STEP(mamba2_step_bf16, uint16_t, bf16)
