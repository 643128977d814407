/*
 * Staged gradient accumulation on the host (ZeRO-Offload's gradient partition), beside the Adam kernel in the same
 * library.
 */
#include "zo_common.h"

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
