/*
 * What the host kernels share (fused_adam.c, accumulate.c): dtype codes, exact scalar conversions between fp32 and
 * bf16/fp16, and the thread-work sizes.
 */
#ifndef ZO_COMMON_H
#define ZO_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define ZO_X86 1
#include <immintrin.h>
#endif

#define ZO_INLINE static inline __attribute__((always_inline))

/* dtype codes shared with fused_adam.py */
enum { ZO_F32 = 0, ZO_BF16 = 1, ZO_F16 = 2 };
enum { ZO_OUT_NONE = 0, ZO_OUT_BF16 = 1, ZO_OUT_F16 = 2 };
#define ZO_BLOCK 65536          /* elements a thread takes at a time */
#define ZO_MIN_PER_THREAD 32768 /* below this a second thread costs more than it saves */

/* ---------------------------------------------------------------- scalar conversions */
ZO_INLINE float zo_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
ZO_INLINE uint32_t zo_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

ZO_INLINE float zo_bf16_to_f32(uint16_t h) { return zo_from_bits((uint32_t)h << 16); }

ZO_INLINE uint16_t zo_f32_to_bf16(float f) { /* c10::BFloat16's round_to_nearest_even */
    uint32_t u = zo_to_bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE fp16 <-> fp32 (the FP16 library's bit tricks, which c10::Half uses). */
ZO_INLINE float zo_f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = zo_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = zo_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    return zo_from_bits(sign | (two_w < (1u << 27) ? zo_to_bits(denormalized) : zo_to_bits(normalized)));
}

ZO_INLINE uint16_t zo_f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = zo_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = zo_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = zo_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* Stochastic rounding to bf16: add 16 random bits below the kept ones, then truncate, so x rounds away from zero
   with probability (its distance from the bf16 below) / (one bf16 ulp): unbiased. The bits are lowbias32 (C.
   Wellons' integer hash) of the element's 32-bit index xor a key per 2**32 elements (zo_key in fused_adam.c):
   the same for any chunking, thread count or ISA. */
ZO_INLINE uint32_t zo_hash(uint32_t x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
    return x;
}

ZO_INLINE uint16_t zo_f32_to_bf16_sr(float f, uint32_t bits) {
    if (f != f) return 0x7FC0;
    return (uint16_t)((zo_to_bits(f) + (bits & 0xFFFFu)) >> 16);
}

ZO_INLINE float zo_load1(const void *p, int64_t i, const int dt) {
    if (dt == ZO_F32) return ((const float *)p)[i];
    if (dt == ZO_BF16) return zo_bf16_to_f32(((const uint16_t *)p)[i]);
    return zo_f16_to_f32(((const uint16_t *)p)[i]);
}

ZO_INLINE void zo_store1(void *p, int64_t i, const int dt, float x) {
    if (dt == ZO_F32) ((float *)p)[i] = x;
    else if (dt == ZO_BF16) ((uint16_t *)p)[i] = zo_f32_to_bf16(x);
    else ((uint16_t *)p)[i] = zo_f32_to_f16(x);
}

#endif /* ZO_COMMON_H */
