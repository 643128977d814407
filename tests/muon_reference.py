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
                  fp32: bool = True) -> dict:
    """{name: fp32 parameter} after ``steps`` steps over the global batch (``ws`` x ``gas`` micro-batches of
    ``MICRO``), the optimizers made by ``make_optimizers(model)`` (one or a list); ``fp32``: within
    `fp32_iteration`."""
    model = make_model()
    optimizers = make_optimizers(model)
    optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
    with torch._dynamo.config.patch(disable=True), (fp32_iteration() if fp32 else nullcontext()):
        for step in range(steps):
            x, y = batch(step, MICRO * gas * ws)
            model.zero_grad()
            model(x, y).backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for opt in optimizers:
                opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
