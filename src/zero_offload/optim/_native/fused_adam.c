/*
 * Fused host Adam/AdamW step over raw buffers: the CPU optimizer of ZeRO-Offload (Ren et al., 2021,
 * Sec. 4.2 "Optimized CPU execution"; DeepSpeed csrc/adam/cpu_adam_impl.cpp plays the same role).
 *
 * One pass over memory per element: read the gradient (fp32, bf16 or fp16) and scale it, update the master
 * weight (fp32, or bf16: DeepSpeed's bf16_master_weights_and_grads, rounded to nearest-even or stochastically)
 * and the two moments (fp32 or bf16), and optionally write the updated weight rounded to nearest-even into a
 * 16-bit buffer. The arithmetic is torch.optim.AdamW's single-tensor order, with the
 * fused multiply-adds torch's vectorised CPU kernels use (lerp, addcmul, add with alpha), so the moments
 * are bitwise those of torch; only the square root differs (ours is IEEE correctly rounded, torch's is
 * within 1 ulp), which moves the weight by at most about one ulp per step.
 *
 * Built three ways in this one file and picked at run time (so no -march flag is needed): AVX-512F,
 * AVX2+FMA+F16C, and portable C. Threads: OpenMP, one contiguous slice of the range per thread.
 * Compile with -ffp-contract=off (and without -ffast-math): every rounding here is written out.
 */
#include "zo_common.h"

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
#define ZO_PREFETCH 64   /* software prefetch ahead (AVX-512 only; slower than the hardware's: off) */
#define ZO_STOCHASTIC 256 /* a bf16 master is rounded stochastically (else to nearest-even) */
#define ZO_MASTER_BF16 512 /* the master weights are bf16 (else fp32) */

typedef struct {
    float grad_scale, decay, l2, w1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
    int32_t flags;
    int32_t prefetch_elems; /* distance for ZO_PREFETCH, elements */
    uint32_t seed;          /* ZO_STOCHASTIC: the step's key; element i's random bits hash (seed, index_base + i) */
    int64_t index_base;     /* the partition offset of element 0, so the bits do not depend on chunks or threads */
} zo_hparams;

/* The step reads master and moments from the *_in pointers and writes them to master/exp_avg/exp_avg_sq: the same
   buffers for a step in place, others for a step out of place (a speculative step keeps what it read). */
typedef struct {
    void *master;
    const void *grad;
    void *exp_avg, *exp_avg_sq, *out;
    const void *master_in;
    const void *exp_avg_in, *exp_avg_sq_in;
} zo_bufs;

ZO_INLINE uint32_t zo_key(const zo_hparams *h, int64_t i) {
    return zo_hash(h->seed ^ zo_hash((uint32_t)((uint64_t)(h->index_base + i) >> 32) + 0x9E3779B9u));
}

/* ---------------------------------------------------------------- portable path (and every tail) */
ZO_INLINE void zo_range_scalar(const int md, const int gd, const int sd, const int od, const zo_bufs *b,
                               int64_t i, int64_t end, const zo_hparams *h) {
    const int32_t fl = h->flags;
    const uint32_t key = (fl & ZO_STOCHASTIC) ? zo_key(h, i) : 0;
    for (; i < end; ++i) {
        float g = zo_load1(b->grad, i, gd);
        if (fl & ZO_SCALE) g = g * h->grad_scale;
        float p = zo_load1(b->master_in, i, md);
        if (fl & ZO_DECAY) p = p * h->decay;                        /* param.mul_(1 - lr*wd) */
        if (fl & ZO_L2) g = fmaf(p, h->l2, g);                       /* grad.add(param, alpha=wd) */
        float m = zo_load1(b->exp_avg_in, i, sd);
        const float diff = g - m;                                    /* exp_avg.lerp_(g, 1 - beta1) */
        m = (fl & ZO_LERP_SMALL) ? fmaf(h->w1, diff, m) : fmaf(h->w1 - 1.0f, diff, g);
        float v = zo_load1(b->exp_avg_sq_in, i, sd) * h->beta2;        /* exp_avg_sq.mul_(beta2) */
        v = fmaf(h->one_minus_beta2 * g, g, v);                      /* .addcmul_(g, g, 1 - beta2) */
        const float d = sqrtf(v) / h->bc2_sqrt + h->eps;            /* (sqrt(v) / sqrt(bc2)).add_(eps) */
        p = p + (h->neg_step_size * m) / d;                          /* param.addcdiv_(m, d, -lr/bc1) */
        if (md == ZO_F32) ((float *)b->master)[i] = p;
        else if (fl & ZO_STOCHASTIC)
            ((uint16_t *)b->master)[i] = zo_f32_to_bf16_sr(p, zo_hash(key ^ (uint32_t)(h->index_base + i)));
        else ((uint16_t *)b->master)[i] = zo_f32_to_bf16(p);
        zo_store1(b->exp_avg, i, sd, m);
        zo_store1(b->exp_avg_sq, i, sd, v);
        if (od != ZO_OUT_NONE) zo_store1(b->out, i, od == ZO_OUT_BF16 ? ZO_BF16 : ZO_F16, p);
    }
}

/* Instantiates FN for each (master, grad, state, out dtype) so that the inner loops carry no dtype tests. */
#define ZO_CASE(FN, M, G, S, O, ...) case (M) * 18 + (G) * 6 + (S) * 3 + (O): FN(M, G, S, O, __VA_ARGS__); break;
#define ZO_CASES_O(FN, M, G, S, ...) ZO_CASE(FN, M, G, S, 0, __VA_ARGS__) ZO_CASE(FN, M, G, S, 1, __VA_ARGS__) \
                                     ZO_CASE(FN, M, G, S, 2, __VA_ARGS__)
#define ZO_CASES_S(FN, M, G, ...) ZO_CASES_O(FN, M, G, 0, __VA_ARGS__) ZO_CASES_O(FN, M, G, 1, __VA_ARGS__)
#define ZO_CASES_G(FN, M, ...) ZO_CASES_S(FN, M, 0, __VA_ARGS__) ZO_CASES_S(FN, M, 1, __VA_ARGS__) \
                               ZO_CASES_S(FN, M, 2, __VA_ARGS__)
#define ZO_SPECIALIZE(FN, md, gd, sd, od, ...)                                 \
    switch ((md) * 18 + (gd) * 6 + (sd) * 3 + (od)) {                          \
        ZO_CASES_G(FN, 0, __VA_ARGS__) ZO_CASES_G(FN, 1, __VA_ARGS__)          \
        default: break;                                                        \
    }

static void zo_run_scalar(int md, int gd, int sd, int od, const zo_bufs *b, int64_t i, int64_t end,
                          const zo_hparams *h) {
    ZO_SPECIALIZE(zo_range_scalar, md, gd, sd, od, b, i, end, h)
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

ZO_T512 ZO_INLINE __m512i zo_hash16(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x7FEB352Du));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* x rounded to bf16 stochastically with the random bits r (zo_f32_to_bf16_sr, 16 lanes) */
ZO_T512 ZO_INLINE __m256i zo_bf16x16_sr(__m512 x, __m512i r) {
    const __m512i add = _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF));
    __m512i q = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), add), 16);
    q = _mm512_mask_mov_epi32(q, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(q);
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

ZO_T512 ZO_INLINE void zo_range512(const int md, const int gd, const int sd, const int od, const zo_bufs *b,
                                   int64_t i, int64_t end, const zo_hparams *h) {
    const int32_t fl = h->flags;
    const __m512 gs = _mm512_set1_ps(h->grad_scale), decay = _mm512_set1_ps(h->decay),
                 l2 = _mm512_set1_ps(h->l2), w1 = _mm512_set1_ps(h->w1),
                 w1m1 = _mm512_set1_ps(h->w1 - 1.0f), b2 = _mm512_set1_ps(h->beta2),
                 omb2 = _mm512_set1_ps(h->one_minus_beta2), bc2 = _mm512_set1_ps(h->bc2_sqrt),
                 eps = _mm512_set1_ps(h->eps), nss = _mm512_set1_ps(h->neg_step_size);
    const int sdsz = sd == ZO_F32 ? 4 : 2, mdsz = md == ZO_F32 ? 4 : 2;
    /* non-temporal stores need aligned addresses; slices start at multiples of 64 elements */
    const int nt_out = (fl & ZO_NT_OUT) && od != ZO_OUT_NONE && ((uintptr_t)b->out + 2 * i) % 32 == 0;
    const int nt_p = (fl & ZO_NT_STATE) && ((uintptr_t)b->master + mdsz * i) % (16 * mdsz) == 0;
    const int sr = md == ZO_BF16 && (fl & ZO_STOCHASTIC);
    const __m512i key = _mm512_set1_epi32(sr ? (int)zo_key(h, i) : 0),
                  lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int nt_s = (fl & ZO_NT_STATE) && ((uintptr_t)b->exp_avg + sdsz * i) % (16 * sdsz) == 0 &&
                     ((uintptr_t)b->exp_avg_sq + sdsz * i) % (16 * sdsz) == 0;
    const int pf = (fl & ZO_PREFETCH) ? h->prefetch_elems : 0;
    for (; i + 16 <= end; i += 16) {
        if (pf && (i & 31) == 0) {
            const int64_t j = i + pf;
            _mm_prefetch((const char *)b->master_in + mdsz * j, _MM_HINT_T0);
            _mm_prefetch((const char *)b->exp_avg_in + sdsz * j, _MM_HINT_T0);
            _mm_prefetch((const char *)b->exp_avg_sq_in + sdsz * j, _MM_HINT_T0);
            _mm_prefetch((const char *)b->grad + (gd == ZO_F32 ? 4 : 2) * j, _MM_HINT_T0);
        }
        __m512 g = zo_ld16(b->grad, i, gd);
        if (fl & ZO_SCALE) g = _mm512_mul_ps(g, gs);
        __m512 p = zo_ld16(b->master_in, i, md);
        if (fl & ZO_DECAY) p = _mm512_mul_ps(p, decay);
        if (fl & ZO_L2) g = _mm512_fmadd_ps(p, l2, g);
        __m512 m = zo_ld16(b->exp_avg_in, i, sd);
        const __m512 diff = _mm512_sub_ps(g, m);
        m = (fl & ZO_LERP_SMALL) ? _mm512_fmadd_ps(w1, diff, m) : _mm512_fmadd_ps(w1m1, diff, g);
        __m512 v = _mm512_mul_ps(zo_ld16(b->exp_avg_sq_in, i, sd), b2);
        v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, v);
        const __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
        p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(nss, m), d));
        if (sr) {
            const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)(h->index_base + i)), lanes);
            const __m256i q = zo_bf16x16_sr(p, zo_hash16(_mm512_xor_si512(key, idx)));
            __m256i *dst = (__m256i *)((uint16_t *)b->master + i);
            if (nt_p) _mm256_stream_si256(dst, q);
            else _mm256_storeu_si256(dst, q);
        } else {
            zo_st16(b->master, i, md, p, nt_p);
        }
        zo_st16(b->exp_avg, i, sd, m, nt_s);
        zo_st16(b->exp_avg_sq, i, sd, v, nt_s);
        if (od != ZO_OUT_NONE) zo_st16(b->out, i, od == ZO_OUT_BF16 ? ZO_BF16 : ZO_F16, p, nt_out);
    }
    if (nt_out || nt_p || nt_s) _mm_sfence();
    zo_range_scalar(md, gd, sd, od, b, i, end, h);
}

ZO_T512 static void zo_run512(int md, int gd, int sd, int od, const zo_bufs *b, int64_t i, int64_t end,
                              const zo_hparams *h) {
    ZO_SPECIALIZE(zo_range512, md, gd, sd, od, b, i, end, h)
}

/* ---------------------------------------------------------------- AVX2 + FMA + F16C: 8 elements per step */
#define ZO_T256 __attribute__((target("avx2,fma,f16c")))

ZO_T256 ZO_INLINE __m256 zo_ld8(const void *p, int64_t i, const int dt) {
    if (dt == ZO_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == ZO_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

ZO_T256 ZO_INLINE __m256i zo_hash8(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x7FEB352Du));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846CA68Bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* x rounded to bf16 stochastically with the random bits r (zo_f32_to_bf16_sr, 8 lanes) */
ZO_T256 ZO_INLINE __m128i zo_bf16x8_sr(__m256 x, __m256i r) {
    const __m256i add = _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF));
    __m256i q = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), add), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    q = _mm256_blendv_epi8(q, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
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

ZO_T256 ZO_INLINE void zo_range256(const int md, const int gd, const int sd, const int od, const zo_bufs *b,
                                   int64_t i, int64_t end, const zo_hparams *h) {
    const int32_t fl = h->flags;
    const __m256 gs = _mm256_set1_ps(h->grad_scale), decay = _mm256_set1_ps(h->decay),
                 l2 = _mm256_set1_ps(h->l2), w1 = _mm256_set1_ps(h->w1),
                 w1m1 = _mm256_set1_ps(h->w1 - 1.0f), b2 = _mm256_set1_ps(h->beta2),
                 omb2 = _mm256_set1_ps(h->one_minus_beta2), bc2 = _mm256_set1_ps(h->bc2_sqrt),
                 eps = _mm256_set1_ps(h->eps), nss = _mm256_set1_ps(h->neg_step_size);
    const int nt_out = (fl & ZO_NT_OUT) && od != ZO_OUT_NONE && ((uintptr_t)b->out + 2 * i) % 16 == 0;
    const int sdsz = sd == ZO_F32 ? 4 : 2, mdsz = md == ZO_F32 ? 4 : 2;
    const int nt_p = (fl & ZO_NT_STATE) && ((uintptr_t)b->master + mdsz * i) % (8 * mdsz) == 0;
    const int sr = md == ZO_BF16 && (fl & ZO_STOCHASTIC);
    const __m256i key = _mm256_set1_epi32(sr ? (int)zo_key(h, i) : 0),
                  lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int nt_s = (fl & ZO_NT_STATE) && ((uintptr_t)b->exp_avg + sdsz * i) % (8 * sdsz) == 0 &&
                     ((uintptr_t)b->exp_avg_sq + sdsz * i) % (8 * sdsz) == 0;
    for (; i + 8 <= end; i += 8) {
        __m256 g = zo_ld8(b->grad, i, gd);
        if (fl & ZO_SCALE) g = _mm256_mul_ps(g, gs);
        __m256 p = zo_ld8(b->master_in, i, md);
        if (fl & ZO_DECAY) p = _mm256_mul_ps(p, decay);
        if (fl & ZO_L2) g = _mm256_fmadd_ps(p, l2, g);
        __m256 m = zo_ld8(b->exp_avg_in, i, sd);
        const __m256 diff = _mm256_sub_ps(g, m);
        m = (fl & ZO_LERP_SMALL) ? _mm256_fmadd_ps(w1, diff, m) : _mm256_fmadd_ps(w1m1, diff, g);
        __m256 v = _mm256_mul_ps(zo_ld8(b->exp_avg_sq_in, i, sd), b2);
        v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, v);
        const __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
        p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), d));
        if (sr) {
            const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)(h->index_base + i)), lanes);
            const __m128i q = zo_bf16x8_sr(p, zo_hash8(_mm256_xor_si256(key, idx)));
            __m128i *dst = (__m128i *)((uint16_t *)b->master + i);
            if (nt_p) _mm_stream_si128(dst, q);
            else _mm_storeu_si128(dst, q);
        } else {
            zo_st8(b->master, i, md, p, nt_p);
        }
        zo_st8(b->exp_avg, i, sd, m, nt_s);
        zo_st8(b->exp_avg_sq, i, sd, v, nt_s);
        if (od != ZO_OUT_NONE) zo_st8(b->out, i, od == ZO_OUT_BF16 ? ZO_BF16 : ZO_F16, p, nt_out);
    }
    if (nt_out || nt_p || nt_s) _mm_sfence();
    zo_range_scalar(md, gd, sd, od, b, i, end, h);
}

ZO_T256 static void zo_run256(int md, int gd, int sd, int od, const zo_bufs *b, int64_t i, int64_t end,
                              const zo_hparams *h) {
    ZO_SPECIALIZE(zo_range256, md, gd, sd, od, b, i, end, h)
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

static void zo_run_isa(int isa, int md, int gd, int sd, int od, const zo_bufs *b, int64_t i, int64_t end,
                       const zo_hparams *h) {
#ifdef ZO_X86
    if (isa == ZO_ISA_AVX512) { zo_run512(md, gd, sd, od, b, i, end, h); return; }
    if (isa == ZO_ISA_AVX2) { zo_run256(md, gd, sd, od, b, i, end, h); return; }
#endif
    (void)isa;
    zo_run_scalar(md, gd, sd, od, b, i, end, h);
}

/* Stochastic rounding keys its bits per 2**32 elements of the partition: a range that crosses such a boundary
   runs in two pieces. */
static void zo_run(int isa, int gd, int sd, int od, const zo_bufs *b, int64_t i, int64_t end,
                   const zo_hparams *h) {
    const int md = (h->flags & ZO_MASTER_BF16) ? ZO_BF16 : ZO_F32;
    while (i < end) {
        int64_t stop = end;
        if (md == ZO_BF16 && (h->flags & ZO_STOCHASTIC)) {
            const int64_t next = (((h->index_base + i) >> 32) + 1) << 32;
            if (next - h->index_base < stop) stop = next - h->index_base;
        }
        zo_run_isa(isa, md, gd, sd, od, b, i, stop, h);
        i = stop;
    }
}


/* One step over elements [0, n), reading master and moments from master_in, exp_avg_in, exp_avg_sq_in (NULL: in
   place) and writing master, exp_avg, exp_avg_sq; the master's dtype is h->flags' ZO_MASTER_BF16. Returns 0, or -1
   for a bad dtype code. */
int zo_adam_step_from(void *master, const void *grad, int gd, void *exp_avg, void *exp_avg_sq, int sd,
                      void *out, int od, int64_t n, const zo_hparams *h, int nthreads, const void *master_in,
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
int zo_adam_step(void *master, const void *grad, int gd, void *exp_avg, void *exp_avg_sq, int sd,
                 void *out, int od, int64_t n, const zo_hparams *h, int nthreads) {
    return zo_adam_step_from(master, grad, gd, exp_avg, exp_avg_sq, sd, out, od, n, h, nthreads, NULL, NULL, NULL);
}
