"""``torch.optim.Muon`` handed to ``deepspeed.initialize`` (or `zero_offload.initialize`'s callers through it).

torch's Muon takes 2-D parameters only, so a model has a second optimizer for the rest. Both are passed as one
list, ``optimizer=[torch.optim.Muon(matrices, ...), torch.optim.AdamW(rest, ...)]``, and become the config's
``"type": "Muon"`` section with ``flavor: "torch"`` (`zero_offload.config.optim.MuonParams`): torch's iteration,
Nesterov switch, coefficients and shape-adjusted lr for the Muon half, the AdamW's settings per group for the rest.
Each parameter's half is recorded on it as ``use_muon`` (as DeepSpeed's ``set_optimizer_flags`` does).
"""
from __future__ import annotations

import torch

__all__ = ["is_torch_muon", "torch_muon_config"]

_ONCE = (("nesterov", "nesterov"), ("ns_coefficients", "ns_coefficients"), ("eps", "ns_eps"),
         ("ns_steps", "ns_steps"), ("adjust_lr_fn", "adjust_lr_fn"))


def is_torch_muon(optimizer) -> bool:
    """A ``torch.optim.Muon``, or a list or tuple holding one."""
    muon = getattr(torch.optim, "Muon", None)
    items = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    return muon is not None and any(isinstance(o, muon) for o in items)


def _plain(v):
    return v.item() if isinstance(v, torch.Tensor) else (list(v) if isinstance(v, tuple) else v)


def torch_muon_config(optimizers, model: torch.nn.Module) -> tuple[dict, list]:
    """(the config's ``optimizer`` section, model_parameters groups) for a ``torch.optim.Muon`` and the
    ``torch.optim.AdamW`` (or ``Adam``) beside it.

    Raises:
        ValueError: no AdamW while trainable parameters are outside the Muon (naming how to pass both), another
            optimizer class, two of one kind, or Muon groups that differ in a setting kept once.
    """
    items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    muons = [o for o in items if isinstance(o, torch.optim.Muon)]
    adams = [o for o in items if type(o) in (torch.optim.AdamW, torch.optim.Adam)]
    others = [type(o).__name__ for o in items if o not in muons and o not in adams]
    if len(muons) != 1 or len(adams) > 1 or others:
        raise ValueError(f"client optimizers {[type(o).__name__ for o in items]}: pass one torch.optim.Muon and at "
                         f"most one torch.optim.AdamW (or Adam) for the other parameters, as "
                         f"optimizer=[torch.optim.Muon(matrices), torch.optim.AdamW(rest)]")
    muon, adam = muons[0], (adams[0] if adams else None)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adam = {id(p) for g in adam.param_groups for p in g["params"]} if adam else set()
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_muon | in_adam]
    if left:
        raise ValueError(f"torch.optim.Muon steps 2-D matrices only, and {len(left)} trainable parameters "
                         f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}) are in no optimizer: pass "
                         f"optimizer=[torch.optim.Muon(matrices, ...), torch.optim.AdamW(rest, ...)]")
    d = muon.defaults
    params = {"flavor": "torch", "muon_lr": _plain(d["lr"]), "momentum": d["momentum"],
              **{ours: _plain(d[theirs]) for theirs, ours in _ONCE}}
    for i, g in enumerate(muon.param_groups):
        for theirs, _ in _ONCE:
            if _plain(g[theirs]) != _plain(d[theirs]):
                raise ValueError(f"client torch.optim.Muon: param group {i} sets {theirs}={g[theirs]!r}, the "
                                 f"others {d[theirs]!r}; per group only lr, momentum and weight_decay may differ")
    groups = []
    for g in muon.param_groups:
        for p in g["params"]:
            p.use_muon = True
        groups.append({"params": list(g["params"]), "lr": _plain(g["lr"]), "momentum": g["momentum"],
                       "weight_decay": g["weight_decay"]})
    if adam is not None:
        a = adam.defaults
        params.update(adam_lr=_plain(a["lr"]), betas=_plain(a["betas"]), eps=a["eps"],
                      adam_w_mode=type(adam) is torch.optim.AdamW)
        for g in adam.param_groups:
            for p in g["params"]:
                p.use_muon = False
            groups.append({"params": list(g["params"]), **{k: _plain(g[k]) for k in
                                                           ("lr", "betas", "eps", "weight_decay")}})
    return {"type": "Muon", "params": params}, groups
