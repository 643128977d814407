/*
 * Muon's elementwise passes over a rank's partition (zero_offload.optim.muon_pass), beside the Adam kernel in the
 * same library: the momentum step in one pass where torch takes four, the update in one where it takes two.
 *
 * Bitwise torch's ops: each lerp is torch's formula for its weight (a + w (b - a) below 1/2, b + (w - 1)(b - a)
 * from 1/2 on) and the update torch's mul then add with alpha. Torch's AVX2 and AVX-512 kernels fuse each of these
 * multiply-adds (fmadd), its portable kernel does not: the caller says which (`fused`), and on x86 the fused
 * version runs with the FMA instruction.
 */
#include "zo_common.h"

#if defined(__GNUC__) && !defined(__clang__)
/* The loops below are written for the auto-vectorizer (no intrinsics): -O2's cheap cost model leaves them scalar.
   -ffp-contract=off still holds, and every operation is elementwise, so the vector code rounds as the scalar. */
#pragma GCC optimize("O3")
#endif

#define ZO_LERP_FMA(a, b, w, small) ((small) ? fmaf((w), (b) - (a), (a)) : fmaf((w) - 1.0f, (b) - (a), (b)))
#define ZO_LERP(a, b, w, small) ((small) ? (a) + (w) * ((b) - (a)) : (b) + ((w) - 1.0f) * ((b) - (a)))

#define ZO_MUON_LOOP(LOAD, LERP)                                                                                    \
    for (int64_t i = lo; i < hi; ++i) {                                                                             \
        const float g = (LOAD) * scale, a = m[i];                                                                   \
        const float next = LERP(a, g, w, w_small);                                                                  \
        m[i] = next;                                                                                                \
        u[i] = nesterov ? LERP(g, next, beta, beta_small) : next;                                                   \
    }

/* Elements [lo, hi) of the momentum step, one function per arithmetic (fused or not). */
#define ZO_MUON_MOMENTUM(NAME, ATTR, LERP)                                                                          \
    ATTR static void NAME(float *m, const void *grad, int gd, float *u, int64_t lo, int64_t hi, float scale,      \
                          float w, float beta, int nesterov) {                                                      \
        const int w_small = w < 0.5f, beta_small = beta < 0.5f;                                                     \
        if (gd == ZO_F32) {                                                                                         \
            const float *s = (const float *)grad;                                                                   \
            ZO_MUON_LOOP(s[i], LERP)                                                                                \
        } else if (gd == ZO_BF16) {                                                                                 \
            const uint16_t *s = (const uint16_t *)grad;                                                             \
            ZO_MUON_LOOP(zo_bf16_to_f32(s[i]), LERP)                                                                \
        } else {                                                                                                    \
            const uint16_t *s = (const uint16_t *)grad;                                                             \
            ZO_MUON_LOOP(zo_f16_to_f32(s[i]), LERP)                                                                 \
        }                                                                                                           \
    }

/* Elements [lo, hi) of the update: torch's master.mul_(decay), then add_(r, alpha=neg_step). */
#define ZO_MUON_UPDATE(NAME, ATTR, FUSED)                                                                           \
    ATTR static void NAME(float *master, const float *r, int64_t lo, int64_t hi, float decay, float neg_step) {     \
        for (int64_t i = lo; i < hi; ++i) {                                                                         \
            const float decayed = master[i] * decay;                                                                \
            master[i] = FUSED ? fmaf(r[i], neg_step, decayed) : decayed + r[i] * neg_step;                          \
        }                                                                                                           \
    }

ZO_MUON_MOMENTUM(momentum_plain, , ZO_LERP)
ZO_MUON_UPDATE(update_plain, , 0)
#ifdef ZO_X86
#define ZO_TFMA __attribute__((target("avx2,fma")))
ZO_MUON_MOMENTUM(momentum_fused, ZO_TFMA, ZO_LERP_FMA)
ZO_MUON_UPDATE(update_fused, ZO_TFMA, 1)
static int zo_has_fma(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
ZO_MUON_MOMENTUM(momentum_fused, , ZO_LERP_FMA)
ZO_MUON_UPDATE(update_fused, , 1)
static int zo_has_fma(void) { return 1; }
#endif

/* STMT over elements [lo, hi) of n, in blocks of ZO_BLOCK shared by `nthreads` OpenMP threads. */
#ifdef _OPENMP
#define ZO_OMP_BLOCKS _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)")
#else
#define ZO_OMP_BLOCKS
#endif
#define ZO_FOR_BLOCKS(n, STMT)                                                                                      \
    ZO_OMP_BLOCKS                                                                                                   \
    for (int64_t k = 0; k < ((n) + ZO_BLOCK - 1) / ZO_BLOCK; ++k) {                                                 \
        const int64_t lo = k * ZO_BLOCK, hi = lo + ZO_BLOCK < (n) ? lo + ZO_BLOCK : (n);                            \
        STMT;                                                                                                       \
    }

static int zo_threads_for(int64_t n, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (n < (int64_t)ZO_MIN_PER_THREAD * nthreads) nthreads = (int)(n / ZO_MIN_PER_THREAD) + 1;
    return nthreads;
}

/* The momentum step on n elements (`momentum_pass`): g = widen(grad[i]) * scale (fp32, bf16 or fp16, widened
   exactly); m[i] = lerp(m[i], g, w) (w = 1 - beta as the caller rounded it); u[i] = lerp(g, m[i], beta) with
   Nesterov, else m[i]. ``fused``: torch's kernels fuse the multiply-adds (its AVX2/AVX-512 capability). Returns 0,
   -1 for a bad dtype code, -2 for ``fused`` on a CPU without FMA. */
int zo_muon_momentum(float *m, const void *grad, int gd, float *u, int64_t n, float scale, float w, float beta,
                     int nesterov, int fused, int nthreads) {
    if (gd < 0 || gd > 2) return -1;
    if (fused && !zo_has_fma()) return -2;
    if (n <= 0) return 0;
    nthreads = zo_threads_for(n, nthreads);
    ZO_FOR_BLOCKS(n, if (fused) momentum_fused(m, grad, gd, u, lo, hi, scale, w, beta, nesterov);
                     else momentum_plain(m, grad, gd, u, lo, hi, scale, w, beta, nesterov))
    return 0;
}

/* The update on n elements: master[i] = master[i] * decay + r[i] * neg_step (decoupled weight decay, then the
   orthogonalized update times -lr x its factor), fused as torch's kernels are (``fused``). Returns 0, or -2 for
   ``fused`` on a CPU without FMA. */
int zo_muon_update(float *master, const float *r, int64_t n, float decay, float neg_step, int fused, int nthreads) {
    if (fused && !zo_has_fma()) return -2;
    if (n <= 0) return 0;
    nthreads = zo_threads_for(n, nthreads);
    ZO_FOR_BLOCKS(n, if (fused) update_fused(master, r, lo, hi, decay, neg_step);
                     else update_plain(master, r, lo, hi, decay, neg_step))
    return 0;
}
