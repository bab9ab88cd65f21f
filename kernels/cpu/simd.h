// SIMD helpers shared by the CPU kernels (kernels/cpu/*.c): float lanes as GCC/Clang vector
// types, bf16 loads, and exp. Sixteen lanes (one zmm register) where the compiler targets
// AVX-512, eight (one ymm) elsewhere: on an AVX-512 host the 16-lane kernels did the same
// work in fewer instructions. The build
// hashes this header with each source (kernels/cpu_build.py).
#ifndef KVPAGER_SIMD_H
#define KVPAGER_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#ifndef LANES  // a source may fix its own width before including this header
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t u32vec __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t u16vec __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline vec load_f32(const float *p) {
    vec v;
    memcpy(&v, p, sizeof(v));
    return v;
}

// bf16 is the top half of a float32: widen, shift, reinterpret (one vpmovzxwd + vpslld).
// Eight lanes on AVX2 say so in intrinsics: GCC's generic convert widened them as two
// halves (vpmovzxwd xmm twice, vpsrldq, vinserti128), which ran the AVX2 small-row linear's
// bf16 weights 2x slower (kernels/cpu/small_linear_avx2.h).
static inline vec load_bf16(const uint16_t *p) {
#if defined(__AVX2__) && LANES == 8
    return (vec)_mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#elif defined(__AVX512F__) && LANES == 16  // the same in one zmm, where GCC also split it
    return (vec)_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#else
    u16vec half;
    memcpy(&half, p, sizeof(half));
    const u32vec bits = __builtin_convertvector(half, u32vec) << 16;
    vec v;
    memcpy(&v, &bits, sizeof(v));
    return v;
#endif
}

static inline float get_bf16(const uint16_t *p) {  // one value, for a row's tail
    const uint32_t bits = (uint32_t)*p << 16;
    float x;
    memcpy(&x, &bits, sizeof(x));
    return x;
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

#if defined(__AVX512F__) && LANES == 16
// 2^y, Cephes' exp2f polynomial on [-0.5, 0.5] and vscalefps for the power (inputs clamped to
// [-126, 126]: a normal float out; a NaN clamps too): 11 operations where vector_exp takes 16
static inline vec exp2_lanes(vec y) {
    y = (vec)_mm512_min_ps(_mm512_max_ps((__m512)y, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(126.0f));
    const vec n = (vec)_mm512_roundscale_ps((__m512)y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vec f = y - n;
    vec p = 1.535336188319500e-4f * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    return (vec)_mm512_scalef_ps((__m512)p, (__m512)n);
}

// exp where a few float ulps do not matter (a sampling weight): exp2_lanes; elsewhere
// vector_exp. Not for values a model computes on: the bf16 MLP gates on it changed enough
// bf16 roundings to move a greedy run past tests/engine/test_smollm2_fp8.py's top-8 window.
static inline vec exp_fast(vec x) { return exp2_lanes(x * 1.44269504088896341f); }
#else
static inline vec exp_fast(vec x) { return vector_exp(x); }
#endif

#endif
