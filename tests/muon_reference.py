"""The unpartitioned references Muon runs are compared with, on one process over the global batch:

- DeepSpeed 0.19.8's own optimizer, ``MuonWithAuxAdam`` with ``torch.optim.AdamW`` as its Adam, its parameters
  tagged by DeepSpeed's ``set_optimizer_flags`` and grouped by ``DeepSpeedEngine._muon_param_groups`` (the
  issue's reference for ``"type": "Muon"``);
- ``torch.optim.Muon`` for the 2-D matrices beside ``torch.optim.AdamW`` for the rest.

Clipping is torch's ``clip_grad_norm_`` over every gradient before the step. DeepSpeed's Newton-Schulz is wrapped in
``torch.compile``; it runs eagerly here (dynamo disabled for the reference only), as the engine runs it.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import torch
import torch._dynamo

from reference16 import U32, Reference16, ulp
from toy_model import batch, make_model

MICRO = 2
MUON = {"lr": 0.004, "muon_lr": 0.01, "momentum": 0.9, "weight_decay": 0.01, "betas": (0.9, 0.99), "eps": 1e-8}


@contextmanager
def fp32_iteration():
    """Within it, every Newton-Schulz iteration runs in fp32: DeepSpeed's, torch's and ours. Which 16-bit dtype a CPU
    iterates in depends on the CPU (fp16 only where oneDNN has it), and a 16-bit iteration turns the last-bit
    differences of a gradient averaged over 2 ranks into whole 16-bit ulps of the update; the 2-rank matrix compares
    the arithmetic of the scheme, the same on any x86-64."""
    import deepspeed.runtime.zero.muon.original_muon as theirs
    import torch.optim._muon as torchs
    import zero_offload.hoststep.muon_owners as owners
    import zero_offload.optim.muon as ours
    saved = theirs.ns_compute_dtype, ours.ns_dtype, owners.ns_dtype, torchs._zeropower_via_newtonschulz
    theirs.ns_compute_dtype = lambda method="gram": torch.float32
    ours.ns_dtype = owners.ns_dtype = lambda rule, device: torch.float32
    torchs._zeropower_via_newtonschulz = _torch_iteration_fp32
    try:
        yield
    finally:
        theirs.ns_compute_dtype, ours.ns_dtype, owners.ns_dtype, torchs._zeropower_via_newtonschulz = saved


def _torch_iteration_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch 2.13's ``_zeropower_via_newtonschulz`` with fp32 where it casts to bf16 (the one change)."""
    a, b, c = ns_coefficients
    x = grad.float().clone()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def deepspeed_muon(params: dict, model):
    """DeepSpeed's Muon over ``model``'s parameters, tagged and grouped as deepspeed.initialize does."""
    from deepspeed import set_optimizer_flags
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params=dict(params)), model)
    groups = DeepSpeedEngine._muon_param_groups(list(model.parameters()), dict(params))
    return MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={})


def torch_muon(model, muon: dict, adamw: dict):
    """``torch.optim.Muon`` over the 2-D parameters, ``torch.optim.AdamW`` over the rest (torch's documented use)."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, **muon), torch.optim.AdamW(rest, **adamw)]


def reference_run(make_optimizers, ws: int = 1, gas: int = 1, clip: float = 0.0, steps: int = 5,
                  fp32: bool = True, clip_update: bool = False) -> dict:
    """{name: fp32 parameter} after ``steps`` steps over the global batch (``ws`` x ``gas`` micro-batches of
    ``MICRO``), the optimizers made by ``make_optimizers(model)`` (one or a list); ``fp32``: within
    `fp32_iteration`. ``clip_update`` (DeepSpeed's ``MuonWithAuxAdam`` only): DeepSpeed 0.19.8's ZeRO order
    (`zero_order_step`), the clip over the orthogonalized updates and the Adam half's gradients."""
    model = make_model()
    optimizers = make_optimizers(model)
    optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
    with torch._dynamo.config.patch(disable=True), (fp32_iteration() if fp32 else nullcontext()):
        for step in range(steps):
            x, y = batch(step, MICRO * gas * ws)
            model.zero_grad()
            model(x, y).backward()
            if clip_update:
                zero_order_step(optimizers[0], model, clip)
                continue
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for opt in optimizers:
                opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def zero_order_step(opt, model, clip: float) -> None:
    """One step of DeepSpeed's ``MuonWithAuxAdam`` in the order DeepSpeed 0.19.8's ZeRO takes it
    (``stage_1_and_2.get_flat_partition``, ``_apply_muon_updates_cpu_offload``): each Muon matrix's gradient is
    replaced by its update (DeepSpeed's ``muon_update``: momentum, Newton-Schulz), the clip runs over those updates and
    the other gradients together, then the Muon matrices take ``- lr x update`` after their decay (the flat-partition
    branch of ``MuonWithAuxAdam.step``) and the Adam half its own step."""
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    muon_groups = [g for g in opt.param_groups if g["use_muon"]]
    for g in muon_groups:
        for p in g["params"]:
            state = opt.state[p]
            state.setdefault("momentum_buffer", torch.zeros_like(p))
            p.grad = muon_update(p.grad, state["momentum_buffer"], beta=g["momentum"],
                                 ns_method=g.get("ns_method", "gram")).reshape(p.shape).to(p.grad.dtype)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    kept = [g["params"] for g in muon_groups]
    for g in muon_groups:
        for p in g["params"]:
            p.mul_(1 - g["lr"] * g["weight_decay"])
            p.add_(p.grad, alpha=-g["lr"])
        g["params"] = []                       # the Adam half only, through the optimizer's own step
    try:
        opt.step()
    finally:
        for g, params in zip(muon_groups, kept):
            g["params"] = params


class MuonReference16(Reference16):
    """`reference16.Reference16` stepped by DeepSpeed's ``MuonWithAuxAdam`` (torch AdamW for the Adam half) with
    ``params``: the same 16-bit gradients, combined with the engine's roundings, unscaled and clipped.

    The bound of one step: an Adam master's is `Reference16.bound` with its group's settings. A Muon master's:
    without clipping (``grad_scale`` a power of two) both sides fold bitwise the same gradient into bitwise the same
    momentum and orthogonalize the same matrix, so they differ only in the decay and the add: 4 ulp of the master
    and ``(32 + 8 t) u lr (|O| + wd |w|)``; with clipping the clip coefficient differs by <= 20 u relative (the sum of
    squares' order), which the iteration may amplify by at most a^5 = 3.4445^5 (its slope at zero, compounded over
    5 iterations): ``20 a^5 u lr max|O|`` more.
    """

    def __init__(self, params: dict = MUON, **kw):
        super().__init__(lr=params["lr"], weight_decay=params["weight_decay"], eps=params["eps"], **kw)
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
        for name, m in zip(self.names, self.masters):
            m.use_muon = m.dim() >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))
        groups = DeepSpeedEngine._muon_param_groups(list(self.masters), dict(params))
        self.opt = MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={})

    def bound(self, m: torch.Tensor, before: torch.Tensor, abs_avg: torch.Tensor) -> torch.Tensor:
        group = next(g for g in self.opt.param_groups if any(p is m for p in g["params"]))
        lr, wd = group["lr"], group["weight_decay"]
        if not group["use_muon"]:       # `Reference16.bound` with this group's settings
            beta1, beta2 = group["betas"]
            abs_avg.mul_(beta1).add_(m.grad.abs(), alpha=1 - beta1)
            denom = (self.opt.state[m]["exp_avg_sq"] / (1 - beta2**self.t)).sqrt() + group["eps"]
            size = lr * (abs_avg / (1 - beta1**self.t) / denom + wd * before.abs())
            return 4 * ulp(m.detach(), torch.float32) + (32 + 8 * self.t) * U32 * size
        update = (before * (1 - lr * wd) - m.detach()).abs() / lr          # |O| as it was applied
        out = 4 * ulp(m.detach(), torch.float32) + (32 + 8 * self.t) * U32 * lr * (update + wd * before.abs())
        if self.clip > 0:
            out += 20 * 3.4445**5 * U32 * lr * update.max()
        return out
