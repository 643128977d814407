"""`Lamb`: LAMB with DeepSpeed 0.19.8's ``FusedLamb`` semantics, per tensor, also over cut tensors.

LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"), as
DeepSpeed's ``deepspeed/ops/lamb/fused_lamb.py`` and ``csrc/lamb/fused_lamb_cuda_kernel.cu`` compute it,
per parameter tensor ``p`` with gradient ``g`` at step ``t``::

    m = beta1 m + (1 - beta1) g
    v = beta2 v + (1 - beta2) g^2
    u = m / (sqrt(v) + eps) + weight_decay p          (eps_inside_sqrt: m / sqrt(v + eps))
    ratio = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 where ||p|| or ||u|| is 0
    step_size = lr sqrt(1 - beta2^t) / (1 - beta1^t)   (lr without bias_correction)
    p = p - step_size ratio u

The moments are not bias-corrected inside ``u`` (DeepSpeed folds the correction into ``step_size``, weight
decay included), and ``||p||`` is taken before the update. Under ZeRO a tensor may be cut across the ranks'
partitions: ``segments`` then say which element ranges of a flat partition belong to which tensor, and
``all_reduce`` sums the per-tensor squared norms over the ranks, so every rank uses the whole tensor's ratio.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch

__all__ = ["Lamb"]

Segment = tuple[int, int, int]      # (start, end) element range of a flat tensor, and the index of its tensor


class Lamb(torch.optim.Optimizer):
    """LAMB over CPU or device tensors (any float dtype is computed in the tensor's own dtype).

    Args:
        params: tensors or param-group dicts (per-group ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``max_coeff``, ``min_coeff``, ``bias_correction``, ``eps_inside_sqrt``).
        lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay, max_coeff, min_coeff: as DeepSpeed's
            ``FusedLamb`` (defaults 1e-3, True, (0.9, 0.999), 1e-8, False, 0.0, 10.0, 0.01).
        amsgrad: must be False (DeepSpeed's FusedLamb raises too).
        segments: {parameter: (segments, count)}: the parameter is a 1-D flat partition whose element ranges
            ``segments`` ((start, end, index) with index < count) are pieces of ``count`` tensors; elements in
            no segment (padding) are not updated. Parameters not listed are one tensor each.
        all_reduce: sums a float tensor of shape (count, 2) over the ranks in place (the squared norms of
            the pieces every rank holds), or None when every tensor is whole on this rank.

    Attributes:
        lamb_coeffs: the trust ratios of the last step, one per tensor, in order (DeepSpeed's
            ``get_lamb_coeffs()``).

    Raises:
        ValueError: a hyper-parameter out of range (negative lr/eps/weight_decay, betas outside [0, 1),
            min_coeff > max_coeff) or ``amsgrad=True``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False, *, segments: dict | None = None,
                 all_reduce: Callable[[torch.Tensor], None] | None = None):
        if amsgrad:
            raise ValueError("Lamb(amsgrad=True): LAMB has no AMSGrad variant (DeepSpeed's FusedLamb raises too)")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Lamb: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas must lie in [0, 1), got {tuple(betas)}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb: need 0 <= min_coeff <= max_coeff, got min_coeff={min_coeff}, "
                             f"max_coeff={max_coeff}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.segments = segments or {}
        self.all_reduce = all_reduce
        self.lamb_coeffs: list[float] = []

    def _pieces(self, p: torch.Tensor) -> tuple[Sequence[Segment], int, bool]:
        for q, (pieces, count) in self.segments.items():
            if q is p:
                return pieces, count, True
        return [(0, p.numel(), 0)], 1, False

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        """One LAMB step of every parameter that has a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
                update = (m / denom).add_(p, alpha=group["weight_decay"]).view(-1)
                flat = p.view(-1)
                pieces, count, cut = self._pieces(p)
                sums = torch.zeros(count, 2, dtype=torch.float32, device=p.device)
                for lo, hi, i in pieces:
                    sums[i, 0] += flat[lo:hi].float().pow(2).sum()
                    sums[i, 1] += update[lo:hi].float().pow(2).sum()
                if cut and self.all_reduce is not None:
                    self.all_reduce(sums)
                norms = sums.sqrt().tolist()
                step_size = group["lr"]
                if group["bias_correction"]:
                    t = state["step"]
                    step_size *= math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
                coeffs = [_trust_ratio(w, u, group["max_coeff"], group["min_coeff"]) for w, u in norms]
                for lo, hi, i in pieces:
                    flat[lo:hi].add_(update[lo:hi], alpha=-step_size * coeffs[i])
                self.lamb_coeffs.extend(coeffs)
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step (DeepSpeed's ``FusedLamb.get_lamb_coeffs``)."""
        return list(self.lamb_coeffs)


def _trust_ratio(w: float, u: float, max_coeff: float, min_coeff: float) -> float:
    if w == 0 or u == 0:
        return 1.0
    return min(max(w / u, min_coeff), max_coeff)
