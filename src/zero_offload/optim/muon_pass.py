"""Muon's two elementwise passes over a rank's partition: the momentum step and the update of the masters.

On host tensors they run in the native library (``zo_muon_momentum``, ``zo_muon_update`` in ``_native/muon.c``):
one pass over memory each, where torch takes four (widen and scale the gradient, two lerps, a copy) and two. The
arithmetic is torch's own: its formula for each lerp and for decay-then-add, with the multiply-adds fused exactly
where torch's CPU kernels fuse them (its AVX2 and AVX-512 capability: `torch.backends.cpu.get_cpu_capability`), so
the results equal torch's ops bitwise. Elsewhere (device tensors, no native library, ``ZERO_OFFLOAD_NO_NATIVE=1``)
torch's ops run (`zero_offload.optim.muon.momentum_step`).
"""
from __future__ import annotations

import functools

import torch

from zero_offload.optim import _native
from zero_offload.optim.muon import MuonRule, momentum_step

__all__ = ["momentum_pass", "update_pass"]

_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def _fused() -> bool:
    """Whether torch's CPU kernels fuse multiply-adds (fmadd in its AVX2 and AVX-512 kernels)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _check(rc: int, name: str) -> None:
    """Raise for a native call that refused its arguments (-1: a dtype code; -2: fused multiply-adds asked for on a
    CPU without FMA, where torch would not fuse either)."""
    if rc:
        raise RuntimeError(f"{name} returned {rc}: " + ("bad gradient dtype code" if rc == -1 else
                                                        "fused multiply-adds asked for on a CPU without FMA"))


def _native_on(*tensors: torch.Tensor):
    """The native library where every tensor is a contiguous host tensor, else None."""
    if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return _native.load()
    return None


@torch.no_grad()
def momentum_pass(momentum: torch.Tensor, grad: torch.Tensor, grad_scale: float, rule: MuonRule,
                  out: torch.Tensor) -> torch.Tensor:
    """Fold ``grad x grad_scale`` into ``momentum`` in place (`momentum_step`) and write the update before
    orthogonalization into ``out``, which it returns.

    Args:
        momentum: 1-D fp32, a partition's momentum (or a piece of it).
        grad: 1-D, as many elements, fp32, bf16 or fp16 (not written).
        grad_scale: the clip coefficient / loss scale.
        rule: the group's `MuonRule` (its momentum and Nesterov).
        out: 1-D fp32, as many elements, on the momentum's device.

    Raises:
        RuntimeError: the native pass refused its arguments (`_check`).
    """
    lib = _native_on(momentum, grad, out) if grad.dtype in _CODES else None
    if lib is None:
        scaled = grad.to(momentum.device, torch.float32, copy=True)
        return out.copy_(momentum_step(momentum, scaled.mul_(grad_scale) if grad_scale != 1.0 else scaled, rule))
    rc = lib.zo_muon_momentum(momentum.data_ptr(), grad.data_ptr(), _CODES[grad.dtype], out.data_ptr(),
                              momentum.numel(), grad_scale, 1 - rule.momentum, rule.momentum, int(rule.nesterov),
                              int(_fused()), torch.get_num_threads())
    _check(rc, "zo_muon_momentum")
    return out


@torch.no_grad()
def update_pass(master: torch.Tensor, result: torch.Tensor, lr: float, weight_decay: float,
                factor: float = 1.0) -> None:
    """``master <- master (1 - lr x weight_decay) - lr x factor x result`` in place: Muon's decoupled weight decay
    and update (``factor``: torch's shape-adjusted lr; 1 for DeepSpeed's). Both 1-D fp32 of one size and device.

    Raises:
        RuntimeError: the native pass refused its arguments (`_check`).
    """
    lib = _native_on(master, result)
    if lib is None:
        master.mul_(1 - lr * weight_decay).add_(result, alpha=-lr * factor)
        return
    rc = lib.zo_muon_update(master.data_ptr(), result.data_ptr(), master.numel(), 1 - lr * weight_decay,
                            -lr * factor, int(_fused()), torch.get_num_threads())
    _check(rc, "zo_muon_update")
