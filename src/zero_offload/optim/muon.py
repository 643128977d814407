"""Muon's arithmetic: the momentum step on a partition, and Newton-Schulz orthogonalization of a whole matrix.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers") runs SGD momentum (Nesterov by default) and replaces
each weight matrix's update by an approximation of its orthogonal polar factor, five quintic Newton-Schulz
iterations with coefficients (3.4445, -4.7750, 2.0315). Two definitions are in use, and `MuonRule` names which:

- ``deepspeed``: DeepSpeed 0.19.8's ``original_muon.muon_update`` (``"optimizer": {"type": "Muon"}``). Nesterov
  always; ``ns_method`` ``"gram"`` (Gram Newton-Schulz on the small side's Gram matrix with a restart at
  iteration 2, in fp16 where the device has it, else fp32) or ``"standard"`` (in bf16); the update is scaled by
  ``sqrt(rows / cols)`` for tall matrices in the iteration's dtype; ``per_head_muon`` orthogonalizes each
  attention head's rows on their own.
- ``torch``: ``torch.optim.Muon`` (PyTorch 2.9+). Nesterov optional; the iteration in bf16 with ``addmm``, the
  norm clamped by ``eps``; the aspect ratio goes into the learning rate (``adjust_lr_fn``).

The momentum step is elementwise, so it runs on each rank's partition where the optimizer state lives; only
`orthogonalize` needs the whole matrix (`zero_offload.hoststep.muon_owners`). The operations and their order are
those of the two sources, so a whole-matrix step here equals theirs bitwise on the same inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["MuonRule", "ns_dtype", "orthogonalize", "momentum_step", "ns_flops"]

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_GRAM_RESTART = 2          # DeepSpeed's Gram iteration rebuilds X and R from Q at this iteration


@dataclass(frozen=True)
class MuonRule:
    """How one param group's Muon update is made.

    Attributes:
        flavor: ``deepspeed`` or ``torch`` (see the module docstring).
        momentum: the momentum factor beta (the buffer is ``lerp(buffer, grad, 1 - beta)``).
        nesterov: the update is ``lerp(grad, buffer, beta)`` instead of the buffer.
        ns_method: ``deepspeed``: ``gram`` or ``standard``; ``torch``: ``torch``.
        ns_steps: Newton-Schulz iterations.
        coefficients: the quintic's (a, b, c) (``torch`` only; DeepSpeed's are fixed).
        eps: ``torch``: the norm's lower clamp; ``deepspeed`` adds 1e-7 to the norm.
        adjust_lr: ``torch``: ``original`` (lr x sqrt(max(1, rows / cols))) or ``match_rms_adamw``
            (lr x 0.2 x sqrt(max(rows, cols))); ``deepspeed``: None (the scale is in the update).
        num_heads: ``per_head_muon``: per parameter index of the group, the attention heads its rows split into.
    """
    flavor: str = "deepspeed"
    momentum: float = 0.95
    nesterov: bool = True
    ns_method: str = "gram"
    ns_steps: int = 5
    coefficients: tuple[float, float, float] = COEFFICIENTS
    eps: float = 1e-7
    adjust_lr: str | None = None

    def lr_factor(self, shape: tuple[int, ...]) -> float:
        """The learning rate's multiplier for a matrix of ``shape`` (torch's ``_adjust_lr``; 1 for DeepSpeed)."""
        if self.flavor != "torch":
            return 1.0
        rows, cols = shape[0], shape[1]
        if self.adjust_lr in (None, "original"):
            return math.sqrt(max(1, rows / cols))
        return 0.2 * math.sqrt(max(rows, cols))


def ns_dtype(rule: MuonRule, device: torch.device) -> torch.dtype:
    """The dtype the iteration runs in: torch's is bf16; DeepSpeed's ``gram`` fp16 and ``standard`` bf16 where
    the device supports them, else fp32 (DeepSpeed's ``ns_compute_dtype`` over its accelerator: on the CPU fp16
    only where oneDNN has it)."""
    if rule.flavor == "torch":
        return torch.bfloat16
    if rule.ns_method == "gram":
        if device.type == "cuda":
            return torch.float16
        return torch.float16 if _cpu_has_fp16() else torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16


def _cpu_has_fp16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:      # a build without oneDNN
        return False


def ns_flops(shape: tuple[int, ...], steps: int = 5) -> float:
    """Multiply-adds of one standard Newton-Schulz orthogonalization of a matrix of ``shape`` (n = the small
    side, m = the large: per iteration X X^T is n^2 m, (A) A n^3, B X n^2 m), x2 for FLOPs; the owners'
    balance weight."""
    rows = shape[0]
    cols = math.prod(shape[1:])
    n, m = min(rows, cols), max(rows, cols)
    return 2.0 * steps * (2 * n * n * m + n ** 3)


@torch.no_grad()
def momentum_step(momentum: torch.Tensor, grad: torch.Tensor, rule: MuonRule) -> torch.Tensor:
    """Fold ``grad`` into ``momentum`` in place (``lerp(momentum, grad, 1 - beta)``) and return the update before
    orthogonalization: ``lerp(grad, momentum, beta)`` written over ``grad`` (Nesterov), else a copy of the
    momentum. Both 1-D partitions (or whole matrices) of one dtype; elementwise, so a partition's result is the
    whole matrix's restricted to it."""
    momentum.lerp_(grad, 1 - rule.momentum)
    return grad.lerp_(momentum, rule.momentum) if rule.nesterov else momentum.clone()


@torch.no_grad()
def orthogonalize(update: torch.Tensor, rule: MuonRule, num_heads: int | None = None) -> torch.Tensor:
    """The orthogonalized update of one whole matrix ``update`` (its layer shape, fp32), in the iteration's
    dtype (`ns_dtype` on ``update``'s device): every value is exact in that dtype, so it travels in it. DeepSpeed's
    includes the aspect-ratio scale; torch's does not (`MuonRule.lr_factor`). ``num_heads``: DeepSpeed's
    ``per_head_muon``, each head's ``rows / num_heads`` rows on their own.

    Raises:
        ValueError: ``num_heads`` that does not divide the rows of a 2-D matrix.
    """
    dtype = ns_dtype(rule, update.device)
    if rule.flavor == "torch":
        return _torch_iteration(update, rule, dtype)
    step = _gram if rule.ns_method == "gram" else _standard
    if num_heads is not None:
        rows, cols = update.shape
        if num_heads < 1 or rows % num_heads:
            raise ValueError(f"per_head_muon: {rows} rows do not split into num_heads={num_heads}")
        per_head = step(update.view(num_heads, rows // num_heads, cols), rule.ns_steps, dtype)
        return (per_head * _aspect_scale(rows // num_heads, cols)).reshape(rows, cols)
    shape = update.shape
    x = update.view(len(update), -1) if update.ndim == 4 else update
    x = step(x, rule.ns_steps, dtype)
    x *= _aspect_scale(shape[-2], shape[-1])
    return x


def _aspect_scale(rows: int, cols: int) -> float:
    return math.sqrt(rows / cols) if rows > cols else 1.0


def _quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    return x


def _standard(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """DeepSpeed's standard iteration: cast, wide side last, normalize, iterate (on a batch of matrices too)."""
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype)
    x = x.mT if tall else x
    x = _quintic(x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7), steps)
    return x.mT if tall else x


def _gram(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """DeepSpeed's Gram iteration: normalized in fp32 (fp16 inputs) or the input's dtype, then the polynomial is
    accumulated in Q on the n x n Gram matrix R, and X = Q X at the restart and at the end."""
    tall = g.size(-2) > g.size(-1)
    x = g.to(torch.float32 if g.dtype == torch.float16 else g.dtype)
    x = x.mT if tall else x
    n, m = x.size(-2), x.size(-1)
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    if m <= n:
        x = _quintic(x, steps)
        return x.mT if tall else x
    a, b, c = COEFFICIENTS
    r, q = x @ x.mT, None
    for i in range(steps):
        if i == _GRAM_RESTART:
            x = q @ x
            r, q = x @ x.mT, None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != _GRAM_RESTART:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return x.mT @ q.mT if tall else q @ x


def _torch_iteration(g: torch.Tensor, rule: MuonRule, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's iteration: bf16, wide side last, norm clamped by eps, addmm forms."""
    if g.ndim != 2:
        raise ValueError(f"torch.optim.Muon orthogonalizes 2-D matrices, got shape {tuple(g.shape)}")
    a, b, c = rule.coefficients
    tall = g.size(0) > g.size(1)
    x = g.to(dtype)
    x = x.T if tall else x
    x.div_(x.norm().clamp(min=rule.eps))
    for _ in range(rule.ns_steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x
