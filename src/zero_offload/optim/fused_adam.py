"""The host Adam/AdamW step on one flat partition: 16-bit gradient in, fp32 (or bf16) state updated, 16-bit
parameter out.

This module is the single Python face of the host kernel (ZeRO-Offload, Ren et al. 2021, Sec. 4.2: the
CPU optimizer; DeepSpeed's ``DeepSpeedCPUAdam`` / ``csrc/adam/cpu_adam_impl.cpp``). `fused_adam_step` runs
the native kernel (`zero_offload.optim._native`, built at install time) in one pass over memory, chunk by
chunk, on all cores. Without it, it falls back to torch (``torch._fused_adamw_`` / ``torch._fused_adam_``,
or torch's ops in ``torch.optim.AdamW``'s order when ``bias_correction=False`` or the states are bf16)
and warns once; it too goes through the partition in pieces of at most ``DEFAULT_CHUNK`` elements, with at
most 4 fp32 scratch buffers of that size (32 MiB) whatever the partition's size.

Accuracy against ``torch.optim.AdamW`` / ``torch.optim.Adam`` (single-tensor, fp32): the moments are
bitwise equal (same operations and fused multiply-adds); the square root is IEEE correctly rounded where
torch's is within 1 ulp, so the updated weight differs by at most ~1 ulp of the weight plus 2**-22 of that
step's update per step (measured: max 1 ulp after 10 steps; tests use rtol=1e-6).

bf16 moments (``exp_avg``/``exp_avg_sq`` of dtype bf16, 8 bytes/param less): computed in fp32, stored
rounded to nearest-even (no stochastic rounding). Each step's update then differs from the fp32-state
update by at most ~1.5 * 2**-8 relatively; over many steps an increment of ``exp_avg_sq`` smaller than
half a bf16 ulp (``(1-beta2) * g**2 < 2**-9 * v``) is lost, so ``v`` decays more slowly than in fp32.
Bound tested in tests/test_fused_adam.py (50 steps, lr=1e-3, decaying gradients):
``max |w_bf16 - w_fp32| <= 0.01 * lr * steps`` (measured 0.0044 * lr * steps at 10 steps, 0.0033 at 200);
``exp_avg`` within 2**-6 of its largest value (measured 0.0075); ``exp_avg_sq`` within 10% relatively
(measured 3.3% max, 0.07% mean).

bf16 master weights (DeepSpeed's ``bf16_master_weights_and_grads``; its CPU Adam widens a bf16 parameter, steps
in fp32 and stores it rounded to nearest-even): the same fp32 arithmetic on the widened weight, then rounded to
nearest-even (bitwise DeepSpeed's rule) or, with ``rounding="stochastic"``, up with probability equal to the
remainder's share of an ulp, from a counter-based hash of (seed, element index): unbiased, reproducible, and the
same bits on every ISA, thread count, chunking and in the fallback (tests/test_fused_adam_bf16_master.py).
Nearest rounding drops every update smaller than half an ulp (2**-9 relative); stochastic keeps it in the mean.
"""
from __future__ import annotations

import ctypes
import math
import warnings
from typing import Callable

import torch

from zero_offload.optim import _native

__all__ = ["fused_adam_step", "native_available", "active_isa", "stochastic_bf16", "DEFAULT_CHUNK", "ROUNDINGS"]

DEFAULT_CHUNK = 1 << 21  # elements per chunk when on_chunk is given: ~1 ms of work, 8 MiB of fp32 master
_GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_STATE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_OUT_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2}
_SCALE, _DECAY, _L2, _LERP_SMALL, _NT_OUT, _NT_STATE, _PREFETCH, _DYNAMIC = 1, 2, 4, 8, 16, 32, 64, 128
_STOCHASTIC, _MASTER_BF16 = 256, 512
_MASTER_CODES = {torch.float32: 0, torch.bfloat16: 1}
ROUNDINGS = ("nearest", "stochastic")
# Kernel tuning, chosen by measurement (BENCHMARKS.md, "Host Adam kernel"): non-temporal stores for the
# write-only 16-bit output (+12%; for the read-modify-write states they cost 35%), 64K-element blocks
# handed to threads in turn (+2%, and a descheduled core no longer holds the others up), no software prefetch.
KERNEL_FLAGS = _NT_OUT | _DYNAMIC
# Out of place (``sources``), the destination is only written: streaming stores skip reading it first (1.5x
# faster; benchmarks/bench_speculative_kernel.py).
STREAM_OUT_OF_PLACE = True
PREFETCH_ELEMS = 0
_warned = False


def native_available() -> bool:
    """True when the compiled kernel is loaded (not disabled by ``ZERO_OFFLOAD_NO_NATIVE=1``)."""
    return _native.load() is not None


def active_isa() -> str:
    """The instruction set the kernel runs with ("avx512", "avx2", "scalar"; see ``ZERO_OFFLOAD_ISA``), or
    "torch fallback" when the kernel is not loaded."""
    return _native.set_isa(None) if native_available() else "torch fallback"


def _check(name: str, t, dtypes: dict, n: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"fused_adam_step: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"fused_adam_step: {name} must be a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes if d is not None)
        raise ValueError(f"fused_adam_step: {name} must have dtype in ({allowed}), got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"fused_adam_step: {name} must be 1-D and contiguous, got shape {tuple(t.shape)}")
    if n is not None and t.numel() != n:
        raise ValueError(f"fused_adam_step: {name} has {t.numel()} elements, master has {n}")


def fused_adam_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
    chunk_size: int | None = None,
    num_threads: int | None = None,
    sources: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rounding: str = "nearest",
    seed: int = 0,
    index_base: int = 0,
) -> None:
    """One Adam (L2) or AdamW (decoupled decay) step over 1-D CPU tensors of equal length N, in place (or, with
    ``sources``, out of place).

    Args:
        master: fp32 [N], or bf16 [N] (DeepSpeed's ``bf16_master_weights_and_grads``: the update is computed in
            fp32 from the widened weight and rounded back as ``rounding`` says), contiguous, updated in place.
        grad: bf16, fp16 or fp32 [N]; multiplied by ``grad_scale`` (1/loss_scale x clip coefficient) first.
        exp_avg, exp_avg_sq: fp32 [N], or both bf16 [N] (half the state memory; see the module docstring
            for the accuracy bound), updated in place.
        step: the 1-based step count used for bias correction.
        out: optional bf16/fp16 [N] that receives the updated master, rounded to nearest-even
            (bitwise ``master.to(out.dtype)``).
        on_chunk: called as ``on_chunk(start, end)`` (element offsets) after each finished chunk, in
            order, from the calling thread; e.g. to start the host-to-device copy of ``out[start:end]``.
        chunk_size: elements per chunk (default: the whole tensor, or ``DEFAULT_CHUNK`` with on_chunk).
        num_threads: threads to use (default ``torch.get_num_threads()``).
        sources: (master, exp_avg, exp_avg_sq) to read the step's inputs from, each like its counterpart, which
            then only receive the result: the sources are left as they were (a speculative step keeps what a
            step with another gradient scale needs: `zero_offload.hoststep.speculation`). Bitwise the in-place
            result. Default: read in place.
        rounding: how a bf16 ``master`` is rounded: "nearest" (nearest-even, DeepSpeed's) or "stochastic" (up
            with probability equal to the distance from the bf16 value below, in bf16 ulps: unbiased, so updates
            smaller than half an ulp still move the weight on average).
        seed: the stochastic rounding's key (uint32; one per step and partition); element ``i``'s random bits are
            a hash of (``seed``, ``index_base + i``), so they do not depend on chunks, threads or the ISA, and the
            torch fallback draws the same ones.
        index_base: the partition offset of element 0 (for the bits above).

    Memory traffic per parameter: 2 (16-bit grad) + 3 x 8 (master, exp_avg, exp_avg_sq read and
    written) + 2 (16-bit out) = 28 bytes with fp32 states, 20 bytes with bf16 states; with a bf16 master (which
    is itself the 16-bit weight: no ``out``) and bf16 states, 2 + 3 x 4 = 14 bytes.

    Mirrors ``torch.optim.AdamW`` (adamw_mode=True) and ``torch.optim.Adam`` with ``weight_decay``
    (adamw_mode=False), as DeepSpeed's ``adam_w_mode`` does.

    Raises:
        ValueError: a tensor of the wrong type, device, dtype, shape or length (the message names it),
            ``step < 1``, an unknown ``rounding``, or ``out`` with a bf16 master.
    """
    _check("master", master, _MASTER_CODES, None)
    if rounding not in ROUNDINGS:
        raise ValueError(f"fused_adam_step: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if master.dtype == torch.bfloat16 and out is not None:
        raise ValueError("fused_adam_step: a bf16 master is the 16-bit weight itself; pass out=None")
    n = master.numel()
    _check("grad", grad, _GRAD_CODES, n)
    _check("exp_avg", exp_avg, _STATE_CODES, n)
    _check("exp_avg_sq", exp_avg_sq, _STATE_CODES, n)
    if exp_avg_sq.dtype != exp_avg.dtype:
        raise ValueError(f"fused_adam_step: exp_avg_sq must have exp_avg's dtype {exp_avg.dtype}, "
                         f"got {exp_avg_sq.dtype}")
    if out is not None:
        _check("out", out, {torch.bfloat16: 1, torch.float16: 2}, n)
    if int(step) < 1:
        raise ValueError(f"fused_adam_step: step must be >= 1 (1-based), got {step}")
    if sources is not None:
        for name, src, dst in zip(("master", "exp_avg", "exp_avg_sq"), sources, (master, exp_avg, exp_avg_sq)):
            _check(f"sources' {name}", src, {dst.dtype: 0}, n)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"fused_adam_step: chunk_size must be >= 1, got {chunk_size}")
    if n == 0:
        return
    chunk = chunk_size or (DEFAULT_CHUNK if on_chunk is not None else n)
    lib = _native.load()
    if lib is None:
        _warn_fallback()
        # torch's ops need fp32 scratch as large as what they are given (the gradient cast and scaled, bf16
        # moments in fp32, the denominator): pieces of at most DEFAULT_CHUNK elements through a few buffers made
        # once per call, so the extra memory is at most 4 chunks, never a multiple of the partition (scratch for
        # a whole partition would be 16 bytes per parameter). Bitwise the result of one call over the
        # whole partition: the ops are elementwise, and pieces start at multiples of 2**21 elements, so torch's
        # fused kernel (which splits its work in whole vectors) keeps its scalar tail where it was.
        piece = min(chunk, DEFAULT_CHUNK)
        scratch = _Scratch(piece)
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            for lo in range(start, end, piece):
                hi = min(end, lo + piece)
                for src, dst in zip(sources or (), (master, exp_avg, exp_avg_sq)):
                    dst[lo:hi].copy_(src[lo:hi])
                _torch_step(master[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], step, lr, beta1,
                            beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale,
                            None if out is None else out[lo:hi], scratch, rounding, seed, index_base + lo)
            if on_chunk is not None:
                on_chunk(start, end)
        return

    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    flags = KERNEL_FLAGS | (_LERP_SMALL if abs(1.0 - beta1) < 0.5 else 0)
    if grad_scale != 1.0:
        flags |= _SCALE
    if weight_decay != 0.0:
        flags |= _DECAY if adamw_mode else _L2
    if PREFETCH_ELEMS:
        flags |= _PREFETCH
    if sources is not None and STREAM_OUT_OF_PLACE:
        flags |= _NT_STATE
    if master.dtype == torch.bfloat16:
        flags |= _MASTER_BF16 | (_STOCHASTIC if rounding == "stochastic" else 0)
    # Constants in double as torch computes them, rounded to fp32 once (as torch does with a Python scalar).
    hp = _native.HParams(grad_scale, 1.0 - lr * weight_decay, weight_decay, 1.0 - beta1, beta2, 1.0 - beta2,
                         math.sqrt(bc2), eps, -lr / bc1, flags, PREFETCH_ELEMS, seed & 0xFFFFFFFF, index_base)
    threads = num_threads or torch.get_num_threads()
    gd, sd, od = _GRAD_CODES[grad.dtype], _STATE_CODES[exp_avg.dtype], _OUT_CODES[None if out is None else out.dtype]
    reads = sources or (master, exp_avg, exp_avg_sq)
    ptrs = [t.data_ptr() for t in (master, grad, exp_avg, exp_avg_sq)] + [0 if out is None else out.data_ptr()]
    ptrs += [t.data_ptr() for t in reads]
    state = exp_avg.element_size()
    width = master.element_size()
    sizes = [width, grad.element_size(), state, state, 2, width, state, state]
    hp_ref = ctypes.byref(hp)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        hp.index_base = index_base + start
        p = [0 if base == 0 else base + start * size for base, size in zip(ptrs, sizes)]
        lib.zo_adam_step_from(p[0], p[1], gd, p[2], p[3], sd, p[4] or None, od, end - start, hp_ref, threads,
                              p[5], p[6], p[7])
        if on_chunk is not None:
            on_chunk(start, end)


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"zero_offload: native host Adam kernel unavailable ({_native.load_error()}); "
                      "using torch's (slower) fused AdamW instead", RuntimeWarning, stacklevel=3)


class _Scratch:
    """fp32 buffers of ``numel`` elements for `_torch_step`, each made on first use and reused by every piece."""

    def __init__(self, numel: int):
        self.numel, self.buffers = numel, {}

    def get(self, name: str, k: int) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.empty(self.numel, dtype=torch.float32)
        return self.buffers[name][:k]


_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """fused_adam.c's ``zo_hash`` (lowbias32) on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32          # int64 products wrap; their low 32 bits are the uint32 product's
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def stochastic_bf16(x: torch.Tensor, seed: int, index_base: int = 0) -> torch.Tensor:
    """fp32 ``x`` [N] rounded to bf16 stochastically with the kernel's bits for elements ``index_base`` ..
    ``index_base + N - 1`` under ``seed``: bitwise what the native kernel stores (the fallback's path)."""
    index = torch.arange(index_base, index_base + x.numel(), dtype=torch.int64)
    key = _hash32((seed & _M32) ^ _hash32(((index >> 32) + 0x9E3779B9) & _M32))
    bits = _hash32(key ^ (index & _M32)) & 0xFFFF
    rounded = ((x.reshape(-1).view(torch.int32).to(torch.int64) & _M32) + bits) >> 16
    rounded = torch.where(torch.isnan(x.reshape(-1)), 0x7FC0, rounded)
    return (rounded - ((rounded & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16).view(x.shape)


def _torch_step(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                bias_correction, grad_scale, out, scratch: _Scratch, rounding: str = "nearest", seed: int = 0,
                index_base: int = 0) -> None:
    """The fallback on one piece: torch's fused kernel where it applies, else torch's ops in AdamW's order; a
    bf16 master is stepped as an fp32 copy and rounded back.

    Every fp32 temporary lives in ``scratch`` (the same kernels as ``grad.float() * grad_scale``,
    ``v.sqrt() / bc2_sqrt`` etc., written into a buffer: bitwise the same values)."""
    if master.dtype == torch.bfloat16:
        wide = scratch.get("master", master.numel()).copy_(master)
        _torch_step(wide, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                    bias_correction, grad_scale, None, scratch)
        master.copy_(wide if rounding == "nearest" else stochastic_bf16(wide, seed, index_base))
        return
    k = master.numel()
    fused = bias_correction and exp_avg.dtype == torch.float32
    l2 = weight_decay != 0.0 and not adamw_mode
    if grad.dtype != torch.float32 or grad_scale != 1.0 or (l2 and not fused):
        g = scratch.get("grad", k).copy_(grad)       # the caller's gradient is never written
        if grad_scale != 1.0:
            g.mul_(grad_scale)
    else:
        g = grad
    if fused:
        fn = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
        fn([master], [g], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))], lr=lr, beta1=beta1,
           beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    else:
        m = scratch.get("exp_avg", k).copy_(exp_avg) if exp_avg.dtype != torch.float32 else exp_avg
        v = scratch.get("exp_avg_sq", k).copy_(exp_avg_sq) if exp_avg_sq.dtype != torch.float32 else exp_avg_sq
        if weight_decay != 0.0:
            if adamw_mode:
                master.mul_(1.0 - lr * weight_decay)
            else:
                g.add_(master, alpha=weight_decay)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        bc1 = 1.0 - beta1**step if bias_correction else 1.0
        bc2_sqrt = math.sqrt(1.0 - beta2**step) if bias_correction else 1.0
        denom = torch.sqrt(v, out=scratch.get("denom", k)).div_(bc2_sqrt).add_(eps)
        master.addcdiv_(m, denom, value=-lr / bc1)
        if m is not exp_avg:
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
    if out is not None:
        out.copy_(master)
