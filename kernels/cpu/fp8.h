// fp8 <-> float on LANES lanes, for the fp8 KV cache: e4m3 (OCP "fn": no infinities, max 448)
// and e5m2 (max 57344). No x86 extension before AVX10.2 converts fp8, so both directions are
// integer and float lane arithmetic in the GCC/Clang vector types of simd.h, which the compiler
// emits as AVX-512(VL) or AVX2 code for -march=native, and as SSE or scalar code elsewhere: one
// source, no intrinsics. Both are exact: decoding is a bit placement, encoding rounds to
// nearest even as torch's float -> float8 conversion does (after clamping to the format's
// range, which keeps NaN-free inputs finite; the codes for NaN/inf are never written).
#ifndef KVPAGER_FP8_H
#define KVPAGER_FP8_H

#include "simd.h"

typedef uint8_t u8vec __attribute__((vector_size(LANES)));

// Decoding: the 7 exponent+mantissa bits go to the float's exponent/mantissa boundary and the
// exponent is re-biased. A subnormal (exponent field 0) gets exponent 1 and then loses the
// implicit one by a subtraction, so no float subnormal is ever formed (those cost microcode
// assists on some cores). Encoding: normals round the float's mantissa to MANT bits with
// integer adds (a carry into the exponent is the right answer); below the smallest normal,
// the value is a multiple of the subnormal step, rounded by the 2^23 trick.
#define DEFINE_FP8(NAME, MANT, BIAS, MAX, MIN_NORMAL, INV_STEP)                                \
static inline vec NAME##_to_f32(const u8vec bytes) {                                          \
    const u32vec b = __builtin_convertvector(bytes, u32vec);                                   \
    const u32vec mag = (b & 0x7Fu) << (23 - MANT);                                             \
    const u32vec normal = mag + ((uint32_t)(127 - BIAS) << 23);                                \
    const u32vec shifted = normal + (1u << 23);                                                \
    vec sub;                                                                                   \
    memcpy(&sub, &shifted, sizeof(sub));                                                       \
    sub -= MIN_NORMAL;                                                                         \
    u32vec sub_bits;                                                                           \
    memcpy(&sub_bits, &sub, sizeof(sub_bits));                                                 \
    const u32vec is_sub = (u32vec)((b & (0x7Fu & ~((1u << MANT) - 1))) == 0);                  \
    const u32vec bits = (sub_bits & is_sub) | (normal & ~is_sub) | ((b & 0x80u) << 24);        \
    vec x;                                                                                     \
    memcpy(&x, &bits, sizeof(x));                                                              \
    return x;                                                                                  \
}                                                                                              \
static inline u8vec f32_to_##NAME(vec x) {                                                     \
    x = clamp(x, -(MAX), MAX);                                                                 \
    u32vec bits;                                                                               \
    memcpy(&bits, &x, sizeof(bits));                                                           \
    const u32vec sign = (bits >> 24) & 0x80u;                                                  \
    const u32vec abs_bits = bits & 0x7FFFFFFFu;                                                \
    const u32vec odd = (abs_bits >> (23 - MANT)) & 1u;                                         \
    const u32vec normal = ((abs_bits + ((1u << (22 - MANT)) - 1) + odd) >> (23 - MANT))         \
                          - ((uint32_t)(127 - BIAS) << MANT);                                  \
    vec a;                                                                                     \
    memcpy(&a, &abs_bits, sizeof(a));                                                          \
    const vec steps = (a * (INV_STEP) + 8388608.0f) - 8388608.0f; /* rint, as floats */        \
    const u32vec sub = __builtin_convertvector(steps, u32vec);                                 \
    const u32vec is_sub = (u32vec)(a < (MIN_NORMAL));                                          \
    return __builtin_convertvector((sub & is_sub) | (normal & ~is_sub) | sign, u8vec);         \
}                                                                                              \
static inline vec load_##NAME(const uint8_t *p) {                                              \
    u8vec bytes;                                                                               \
    memcpy(&bytes, p, sizeof(bytes));                                                          \
    return NAME##_to_f32(bytes);                                                               \
}

DEFINE_FP8(fp8_e4m3, 3, 7, 448.0f, 0x1p-6f, 0x1p9f)
DEFINE_FP8(fp8_e5m2, 2, 15, 57344.0f, 0x1p-14f, 0x1p16f)

#endif
