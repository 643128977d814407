/*
 * Fused host Adam/AdamW step over raw buffers: the CPU optimizer of ZeRO-Offload (Ren et al., 2021,
 * Sec. 4.2 "Optimized CPU execution"; DeepSpeed csrc/adam/cpu_adam_impl.cpp plays the same role).
 *
 * One pass over memory per element: read the gradient (fp32, bf16 or fp16) and scale it, update the fp32
 * master weight and the two moments (fp32 or bf16), and optionally write the updated weight rounded to
 * nearest-even into a 16-bit buffer. The arithmetic is torch.optim.AdamW's single-tensor order, with the
 * fused multiply-adds torch's vectorised CPU kernels use (lerp, addcmul, add with alpha), so the moments
 * are bitwise those of torch; only the square root differs (ours is IEEE correctly rounded, torch's is
 * within 1 ulp), which moves the weight by at most about one ulp per step.
 *
 * Built three ways in this one file and picked at run time (so no -march flag is needed): AVX-512F,
 * AVX2+FMA+F16C, and portable C. Threads: OpenMP, one contiguous slice of the range per thread.
 * Compile with -ffp-contract=off (and without -ffast-math): every rounding here is written out.
 */
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
/* ISA codes */
enum { ZO_ISA_SCALAR = 0, ZO_ISA_AVX2 = 1, ZO_ISA_AVX512 = 2 };
/* flags */
#define ZO_SCALE 1       /* g *= grad_scale */
#define ZO_DECAY 2       /* AdamW: p *= decay (1 - lr*wd) */
#define ZO_L2 4          /* Adam: g += l2 * p */
#define ZO_LERP_SMALL 8  /* |1 - beta1| < 0.5: torch's lerp takes its first branch */
#define ZO_NT_OUT 16     /* non-temporal stores for the 16-bit output */
#define ZO_NT_STATE 32   /* non-temporal stores for master and moments (slower in place; on out of place, where
                            nothing reads the destination, they save its read-for-ownership) */
#define ZO_DYNAMIC 128   /* threads take ZO_BLOCK-element blocks in turn instead of one slice each */
#define ZO_BLOCK 65536
#define ZO_PREFETCH 64   /* software prefetch ahead (AVX-512 only; slower than the hardware's: off) */

typedef struct {
    float grad_scale, decay, l2, w1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
    int32_t flags;
    int32_t prefetch_elems; /* distance for ZO_PREFETCH, elements */
} zo_hparams;

/* The step reads master and moments from the *_in pointers and writes them to master/exp_avg/exp_avg_sq: the same
   buffers for a step in place, others for a step out of place (a speculative step keeps what it read). */
typedef struct {
    float *master;
    const void *grad;
    void *exp_avg, *exp_avg_sq, *out;
    const float *master_in;
    const void *exp_avg_in, *exp_avg_sq_in;
} zo_bufs;

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

/* ---------------------------------------------------------------- portable path (and every tail) */
ZO_INLINE void zo_range_scalar(const int gd, const int sd, const int od, const zo_bufs *b, int64_t i,
                               int64_t end, const zo_hparams *h) {
    const int32_t fl = h->flags;
    for (; i < end; ++i) {
        float g = zo_load1(b->grad, i, gd);
        if (fl & ZO_SCALE) g = g * h->grad_scale;
        float p = b->master_in[i];
        if (fl & ZO_DECAY) p = p * h->decay;                        /* param.mul_(1 - lr*wd) */
        if (fl & ZO_L2) g = fmaf(p, h->l2, g);                       /* grad.add(param, alpha=wd) */
        float m = zo_load1(b->exp_avg_in, i, sd);
        const float diff = g - m;                                    /* exp_avg.lerp_(g, 1 - beta1) */
        m = (fl & ZO_LERP_SMALL) ? fmaf(h->w1, diff, m) : fmaf(h->w1 - 1.0f, diff, g);
        float v = zo_load1(b->exp_avg_sq_in, i, sd) * h->beta2;        /* exp_avg_sq.mul_(beta2) */
        v = fmaf(h->one_minus_beta2 * g, g, v);                      /* .addcmul_(g, g, 1 - beta2) */
        const float d = sqrtf(v) / h->bc2_sqrt + h->eps;            /* (sqrt(v) / sqrt(bc2)).add_(eps) */
        p = p + (h->neg_step_size * m) / d;                          /* param.addcdiv_(m, d, -lr/bc1) */
        b->master[i] = p;
        zo_store1(b->exp_avg, i, sd, m);
        zo_store1(b->exp_avg_sq, i, sd, v);
        if (od != ZO_OUT_NONE) zo_store1(b->out, i, od == ZO_OUT_BF16 ? ZO_BF16 : ZO_F16, p);
    }
}

/* Instantiates FN for each (grad dtype, state dtype, out dtype) so that the inner loops carry no dtype tests. */
#define ZO_CASE(FN, G, S, O, ...) case (G) * 6 + (S) * 3 + (O): FN(G, S, O, __VA_ARGS__); break;
#define ZO_CASES_O(FN, G, S, ...) ZO_CASE(FN, G, S, 0, __VA_ARGS__) ZO_CASE(FN, G, S, 1, __VA_ARGS__) \
                                  ZO_CASE(FN, G, S, 2, __VA_ARGS__)
#define ZO_CASES_S(FN, G, ...) ZO_CASES_O(FN, G, 0, __VA_ARGS__) ZO_CASES_O(FN, G, 1, __VA_ARGS__)
#define ZO_SPECIALIZE(FN, gd, sd, od, ...)                                                            \
    switch ((gd) * 6 + (sd) * 3 + (od)) {                                                             \
        ZO_CASES_S(FN, 0, __VA_ARGS__) ZO_CASES_S(FN, 1, __VA_ARGS__) ZO_CASES_S(FN, 2, __VA_ARGS__) \
        default: break;                                                                               \
    }

static void zo_run_scalar(int gd, int sd, int od, const zo_bufs *b, int64_t i, int64_t end,
                          const zo_hparams *h) {
    ZO_SPECIALIZE(zo_range_scalar, gd, sd, od, b, i, end, h)
}

#ifdef ZO_X86
/* ---------------------------------------------------------------- AVX-512F: 16 elements per step */
#define ZO_T512 __attribute__((target("avx512f,avx2,fma,f16c")))

ZO_T512 ZO_INLINE __m512 zo_ld16(const void *p, int64_t i, const int dt) {
    if (dt == ZO_F32) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (dt == ZO_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

ZO_T512 ZO_INLINE __m256i zo_bf16x16(__m512 x) { /* round to nearest-even, NaN -> 0x7FC0 */
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

ZO_T512 ZO_INLINE void zo_st16(void *p, int64_t i, const int dt, __m512 x, int nt) {
    if (dt == ZO_F32) {
        if (nt) _mm512_stream_ps((float *)p + i, x);
        else _mm512_storeu_ps((float *)p + i, x);
        return;
    }
    const __m256i h = dt == ZO_BF16 ? zo_bf16x16(x) : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i *q = (__m256i *)((uint16_t *)p + i);
    if (nt) _mm256_stream_si256(q, h);
    else _mm256_storeu_si256(q, h);
}

ZO_T512 ZO_INLINE void zo_range512(const int gd, const int sd, const int od, const zo_bufs *b, int64_t i,
                                   int64_t end, const zo_hparams *h) {
    const int32_t fl = h->flags;
    const __m512 gs = _mm512_set1_ps(h->grad_scale), decay = _mm512_set1_ps(h->decay),
                 l2 = _mm512_set1_ps(h->l2), w1 = _mm512_set1_ps(h->w1),
                 w1m1 = _mm512_set1_ps(h->w1 - 1.0f), b2 = _mm512_set1_ps(h->beta2),
                 omb2 = _mm512_set1_ps(h->one_minus_beta2), bc2 = _mm512_set1_ps(h->bc2_sqrt),
                 eps = _mm512_set1_ps(h->eps), nss = _mm512_set1_ps(h->neg_step_size);
    const int sdsz = sd == ZO_F32 ? 4 : 2;
    /* non-temporal stores need aligned addresses; slices start at multiples of 64 elements */
    const int nt_out = (fl & ZO_NT_OUT) && od != ZO_OUT_NONE && ((uintptr_t)b->out + 2 * i) % 32 == 0;
    const int nt_p = (fl & ZO_NT_STATE) && ((uintptr_t)(b->master + i)) % 64 == 0;
    const int nt_s = (fl & ZO_NT_STATE) && ((uintptr_t)b->exp_avg + sdsz * i) % (16 * sdsz) == 0 &&
                     ((uintptr_t)b->exp_avg_sq + sdsz * i) % (16 * sdsz) == 0;
    const int pf = (fl & ZO_PREFETCH) ? h->prefetch_elems : 0;
    for (; i + 16 <= end; i += 16) {
        if (pf && (i & 31) == 0) {
            const int64_t j = i + pf;
            _mm_prefetch((const char *)(b->master_in + j), _MM_HINT_T0);
            _mm_prefetch((const char *)b->exp_avg_in + sdsz * j, _MM_HINT_T0);
            _mm_prefetch((const char *)b->exp_avg_sq_in + sdsz * j, _MM_HINT_T0);
            _mm_prefetch((const char *)b->grad + (gd == ZO_F32 ? 4 : 2) * j, _MM_HINT_T0);
        }
        __m512 g = zo_ld16(b->grad, i, gd);
        if (fl & ZO_SCALE) g = _mm512_mul_ps(g, gs);
        __m512 p = _mm512_loadu_ps(b->master_in + i);
        if (fl & ZO_DECAY) p = _mm512_mul_ps(p, decay);
        if (fl & ZO_L2) g = _mm512_fmadd_ps(p, l2, g);
        __m512 m = zo_ld16(b->exp_avg_in, i, sd);
        const __m512 diff = _mm512_sub_ps(g, m);
        m = (fl & ZO_LERP_SMALL) ? _mm512_fmadd_ps(w1, diff, m) : _mm512_fmadd_ps(w1m1, diff, g);
        __m512 v = _mm512_mul_ps(zo_ld16(b->exp_avg_sq_in, i, sd), b2);
        v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, v);
        const __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
        p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(nss, m), d));
        zo_st16(b->master, i, ZO_F32, p, nt_p);
        zo_st16(b->exp_avg, i, sd, m, nt_s);
        zo_st16(b->exp_avg_sq, i, sd, v, nt_s);
        if (od != ZO_OUT_NONE) zo_st16(b->out, i, od == ZO_OUT_BF16 ? ZO_BF16 : ZO_F16, p, nt_out);
    }
    if (nt_out || nt_p || nt_s) _mm_sfence();
    zo_range_scalar(gd, sd, od, b, i, end, h);
}

ZO_T512 static void zo_run512(int gd, int sd, int od, const zo_bufs *b, int64_t i, int64_t end,
                              const zo_hparams *h) {
    ZO_SPECIALIZE(zo_range512, gd, sd, od, b, i, end, h)
}

/* ---------------------------------------------------------------- AVX2 + FMA + F16C: 8 elements per step */
#define ZO_T256 __attribute__((target("avx2,fma,f16c")))

ZO_T256 ZO_INLINE __m256 zo_ld8(const void *p, int64_t i, const int dt) {
    if (dt == ZO_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == ZO_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

ZO_T256 ZO_INLINE void zo_st8(void *p, int64_t i, const int dt, __m256 x, int nt) {
    if (dt == ZO_F32) {
        if (nt) _mm256_stream_ps((float *)p + i, x);
        else _mm256_storeu_ps((float *)p + i, x);
        return;
    }
    __m128i h;
    if (dt == ZO_BF16) {
        const __m256i u = _mm256_castps_si256(x);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
        h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    } else {
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    if (nt) _mm_stream_si128((__m128i *)((uint16_t *)p + i), h);
    else _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}

ZO_T256 ZO_INLINE void zo_range256(const int gd, const int sd, const int od, const zo_bufs *b, int64_t i,
                                   int64_t end, const zo_hparams *h) {
    const int32_t fl = h->flags;
    const __m256 gs = _mm256_set1_ps(h->grad_scale), decay = _mm256_set1_ps(h->decay),
                 l2 = _mm256_set1_ps(h->l2), w1 = _mm256_set1_ps(h->w1),
                 w1m1 = _mm256_set1_ps(h->w1 - 1.0f), b2 = _mm256_set1_ps(h->beta2),
                 omb2 = _mm256_set1_ps(h->one_minus_beta2), bc2 = _mm256_set1_ps(h->bc2_sqrt),
                 eps = _mm256_set1_ps(h->eps), nss = _mm256_set1_ps(h->neg_step_size);
    const int nt_out = (fl & ZO_NT_OUT) && od != ZO_OUT_NONE && ((uintptr_t)b->out + 2 * i) % 16 == 0;
    const int sdsz = sd == ZO_F32 ? 4 : 2;
    const int nt_p = (fl & ZO_NT_STATE) && ((uintptr_t)(b->master + i)) % 32 == 0;
    const int nt_s = (fl & ZO_NT_STATE) && ((uintptr_t)b->exp_avg + sdsz * i) % (8 * sdsz) == 0 &&
                     ((uintptr_t)b->exp_avg_sq + sdsz * i) % (8 * sdsz) == 0;
    for (; i + 8 <= end; i += 8) {
        __m256 g = zo_ld8(b->grad, i, gd);
        if (fl & ZO_SCALE) g = _mm256_mul_ps(g, gs);
        __m256 p = _mm256_loadu_ps(b->master_in + i);
        if (fl & ZO_DECAY) p = _mm256_mul_ps(p, decay);
        if (fl & ZO_L2) g = _mm256_fmadd_ps(p, l2, g);
        __m256 m = zo_ld8(b->exp_avg_in, i, sd);
        const __m256 diff = _mm256_sub_ps(g, m);
        m = (fl & ZO_LERP_SMALL) ? _mm256_fmadd_ps(w1, diff, m) : _mm256_fmadd_ps(w1m1, diff, g);
        __m256 v = _mm256_mul_ps(zo_ld8(b->exp_avg_sq_in, i, sd), b2);
        v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, v);
        const __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
        p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), d));
        zo_st8(b->master, i, ZO_F32, p, nt_p);
        zo_st8(b->exp_avg, i, sd, m, nt_s);
        zo_st8(b->exp_avg_sq, i, sd, v, nt_s);
        if (od != ZO_OUT_NONE) zo_st8(b->out, i, od == ZO_OUT_BF16 ? ZO_BF16 : ZO_F16, p, nt_out);
    }
    if (nt_out || nt_p || nt_s) _mm_sfence();
    zo_range_scalar(gd, sd, od, b, i, end, h);
}

ZO_T256 static void zo_run256(int gd, int sd, int od, const zo_bufs *b, int64_t i, int64_t end,
                              const zo_hparams *h) {
    ZO_SPECIALIZE(zo_range256, gd, sd, od, b, i, end, h)
}
#endif /* ZO_X86 */

/* ---------------------------------------------------------------- dispatch and threads */
static int zo_best_isa(void) {
#ifdef ZO_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return ZO_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ZO_ISA_AVX2;
#endif
    return ZO_ISA_SCALAR;
}

static int zo_isa = -1;

/* The ISA the kernel uses: the best this CPU has, or `want` if lower (want < 0: keep/auto). */
int zo_set_isa(int want) {
    const int best = zo_best_isa();
    zo_isa = (want < 0 || want > best) ? best : want;
    return zo_isa;
}

int zo_num_threads_max(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static void zo_run(int isa, int gd, int sd, int od, const zo_bufs *b, int64_t i, int64_t end,
                   const zo_hparams *h) {
#ifdef ZO_X86
    if (isa == ZO_ISA_AVX512) { zo_run512(gd, sd, od, b, i, end, h); return; }
    if (isa == ZO_ISA_AVX2) { zo_run256(gd, sd, od, b, i, end, h); return; }
#endif
    (void)isa;
    zo_run_scalar(gd, sd, od, b, i, end, h);
}

#define ZO_MIN_PER_THREAD 32768 /* below this a second thread costs more than it saves */

/* One step over elements [0, n), reading master and moments from master_in, exp_avg_in, exp_avg_sq_in (NULL: in
   place) and writing master, exp_avg, exp_avg_sq. Returns 0, or -1 for a bad dtype code. */
int zo_adam_step_from(float *master, const void *grad, int gd, void *exp_avg, void *exp_avg_sq, int sd,
                      void *out, int od, int64_t n, const zo_hparams *h, int nthreads, const float *master_in,
                      const void *exp_avg_in, const void *exp_avg_sq_in) {
    if (gd < 0 || gd > 2 || sd < 0 || sd > 1 || od < 0 || od > 2) return -1;
    if (n <= 0) return 0;
    if (zo_isa < 0) zo_set_isa(-1);
    const zo_bufs b = {master, grad, exp_avg, exp_avg_sq, out, master_in ? master_in : master,
                       exp_avg_in ? exp_avg_in : exp_avg, exp_avg_sq_in ? exp_avg_sq_in : exp_avg_sq};
    const int isa = zo_isa;
    if (nthreads < 1) nthreads = 1;
    if (n < (int64_t)ZO_MIN_PER_THREAD * nthreads) nthreads = (int)(n / ZO_MIN_PER_THREAD) + 1;
#ifdef _OPENMP
    if (h->flags & ZO_DYNAMIC) {
        const int64_t nblocks = (n + ZO_BLOCK - 1) / ZO_BLOCK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
        for (int64_t k = 0; k < nblocks; ++k) {
            const int64_t lo = k * ZO_BLOCK, hi = lo + ZO_BLOCK < n ? lo + ZO_BLOCK : n;
            zo_run(isa, gd, sd, od, &b, lo, hi, h);
        }
        return 0;
    }
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    {
        const int t = 0, nt = 1;
#endif
        int64_t per = (n + nt - 1) / nt;
        per = (per + 63) & ~(int64_t)63; /* slices start on 64-element (256-byte) boundaries */
        const int64_t lo = per * t, hi = lo + per < n ? lo + per : n;
        if (lo < hi) zo_run(isa, gd, sd, od, &b, lo, hi, h);
    }
    return 0;
}

/* One step in place over elements [0, n). Returns 0, or -1 for a bad dtype code. */
int zo_adam_step(float *master, const void *grad, int gd, void *exp_avg, void *exp_avg_sq, int sd,
                 void *out, int od, int64_t n, const zo_hparams *h, int nthreads) {
    return zo_adam_step_from(master, grad, gd, exp_avg, exp_avg_sq, sd, out, od, n, h, nthreads, NULL, NULL, NULL);
}

/* ---------------------------------------------------------------- staged gradient accumulation */
/* dst[i] = src[i] (overwrite) or dst[i] + src[i], src fp32, bf16 or fp16 widened exactly to fp32 (so dst is
   bitwise torch's dst.copy_(src) / dst.add_(src)), and the sum of squares of the new dst, accumulated in double
   per thread, in *sumsq. One pass over memory: the host side of ZeRO-Offload's gradient accumulation (DeepSpeed
   adds each micro-step's gradient into the fp32 CPU partition). Returns 0, or -1 for a bad dtype code. */
int zo_accumulate(float *dst, const void *src, int sd, int64_t n, int overwrite, int nthreads, double *sumsq) {
    if (sd < 0 || sd > 2) return -1;
    double total = 0.0;
    if (n <= 0) { *sumsq = 0.0; return 0; }
    if (nthreads < 1) nthreads = 1;
    if (n < (int64_t)ZO_MIN_PER_THREAD * nthreads) nthreads = (int)(n / ZO_MIN_PER_THREAD) + 1;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(+ : total) if (nthreads > 1)
#endif
    for (int64_t k = 0; k < (n + ZO_BLOCK - 1) / ZO_BLOCK; ++k) {
        const int64_t lo = k * ZO_BLOCK, hi = lo + ZO_BLOCK < n ? lo + ZO_BLOCK : n;
        double part = 0.0;
        if (sd == ZO_F32) {
            const float *s = (const float *)src;
            for (int64_t i = lo; i < hi; ++i) {
                const float x = overwrite ? s[i] : dst[i] + s[i];
                dst[i] = x;
                part += (double)x * x;
            }
        } else if (sd == ZO_BF16) {
            const uint16_t *s = (const uint16_t *)src;
            for (int64_t i = lo; i < hi; ++i) {
                const float g = zo_bf16_to_f32(s[i]), x = overwrite ? g : dst[i] + g;
                dst[i] = x;
                part += (double)x * x;
            }
        } else {
            const uint16_t *s = (const uint16_t *)src;
            for (int64_t i = lo; i < hi; ++i) {
                const float g = zo_f16_to_f32(s[i]), x = overwrite ? g : dst[i] + g;
                dst[i] = x;
                part += (double)x * x;
            }
        }
        total += part;
    }
    *sumsq = total;
    return 0;
}
