"""The host side of gradient accumulation: one staged micro-step piece added into the fp32 gradient partition, and
the sum of squares of the result, in one pass over memory on a fixed number of threads (it runs beside training,
bound by memory bandwidth).

ZeRO-Offload accumulates a step's micro-batch gradients in the fp32 partition in host memory (DeepSpeed's stage 1/2
with ``cpu_offload`` adds each reduced piece into its fp32 CPU buffer). The native kernel (``zo_accumulate`` in
``_native/fused_adam.c``, the host Adam kernel's library) widens the fp32/bf16/fp16 piece exactly, so the partition
is bitwise what torch's ``dst.add_(src)`` (or ``dst.copy_(src)``) writes; the sum of squares, which the global norm
takes instead of reading the partition again, is accumulated in double per thread (torch's fp32 ``vector_norm``
differs from it by a few fp32 ulps). Without the kernel, torch's ops do the same on torch's threads.
"""
from __future__ import annotations

import ctypes

import torch

from zero_offload.optim import _native

__all__ = ["accumulate", "STAGED_ADD_THREADS"]

# The staged adds' threads: they run beside backward (the training thread) and, under the delayed update, beside its
# host step, and at ~10 bytes per element they are bound by memory bandwidth, which a few threads reach.
STAGED_ADD_THREADS = 4
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def accumulate(dst: torch.Tensor, src: torch.Tensor, overwrite: bool, threads: int) -> torch.Tensor:
    """``dst = src`` (``overwrite``) or ``dst += src``, then the sum of squares of ``dst``.

    Args:
        dst: the gradient partition's piece, fp32 (or bf16: ``bf16_master_weights_and_grads``, each add rounded to
            nearest-even as DeepSpeed's bf16 add rounds; in torch, two passes), 1-D, contiguous, on the CPU.
        src: the staged piece, fp32, bf16 or fp16, 1-D, contiguous, on the CPU, as many elements as ``dst``.
        overwrite: the step's first micro-step (convert) rather than a later one (add).
        threads: the kernel's OpenMP threads (>= 1; fewer for a piece too small to share).

    Returns:
        A 0-d fp32 tensor: the sum of squares of ``dst`` after the add.

    Raises:
        ValueError: a tensor of the wrong device, dtype, shape or length, or ``threads`` < 1 (the message names it).
    """
    for name, t, dtypes in (("dst", dst, (torch.float32, torch.bfloat16)), ("src", src, tuple(_CODES))):
        if t.device.type != "cpu" or t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"accumulate: {name} must be a 1-D contiguous CPU tensor of dtype in {dtypes}, got "
                             f"{t.dtype} of shape {tuple(t.shape)} on {t.device}")
    if src.numel() != dst.numel():
        raise ValueError(f"accumulate: src has {src.numel()} elements, dst has {dst.numel()}")
    if threads < 1:
        raise ValueError(f"accumulate: threads must be >= 1, got {threads}")
    lib = _native.load() if dst.dtype == torch.float32 else None
    if lib is None:
        dst.copy_(src) if overwrite else dst.add_(src)
        return torch.linalg.vector_norm(dst, dtype=torch.float32).square()
    total = ctypes.c_double()
    lib.zo_accumulate(dst.data_ptr(), src.data_ptr(), _CODES[src.dtype], dst.numel(), int(overwrite), threads,
                      ctypes.byref(total))
    return torch.tensor(total.value, dtype=torch.float32)
