"""`param_groups`: the engine's param groups from a model and ``model_parameters``, as ``deepspeed.initialize`` takes
them (parameters, or param-group dicts with their own hyper-parameters)."""
from __future__ import annotations

import torch

from zero_offload.muon_heads import attention_heads
from zero_offload.zero import ParamGroup

__all__ = ["param_groups", "takes_muon"]


def takes_muon(p: torch.Tensor, name: str) -> bool:
    """Whether optimizer type Muon steps ``p`` with Muon (else AdamW): its ``use_muon`` attribute where the user
    set one, else DeepSpeed 0.19.8's rule (``set_optimizer_flags``): a matrix (2-D or more) whose name has neither
    "embed" nor "lm_head"."""
    if hasattr(p, "use_muon"):
        return bool(p.use_muon)
    return p.dim() >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def param_groups(module: torch.nn.Module, model_parameters, opt) -> list[ParamGroup]:
    """The trainable parameters of ``module`` in groups, each in model order with its names, positions and
    hyper-parameters (``opt.group_hyperparameters``: the config's optimizer params overridden by the group's keys).
    Optimizer type Muon splits each group into its Muon half, then its AdamW half (`takes_muon`), as DeepSpeed's
    ``_muon_param_groups``.
    ``model_parameters``: None (every parameter with ``requires_grad``, one group), parameters, or group dicts;
    groups left with no trainable parameter are dropped.

    Raises:
        ValueError: a group naming a parameter not in ``module``, or no trainable parameter at all.
    """
    named = list(module.named_parameters())
    where = {id(p): (i, n) for i, (n, p) in enumerate(named)}
    if model_parameters is None:
        raw = [{"params": [p for _, p in named]}]
    else:
        raw = list(model_parameters)
        if raw and not isinstance(raw[0], dict):
            raw = [{"params": raw}]
    groups = []
    for gi, g in enumerate(raw):
        params = [p for p in g["params"] if p.requires_grad]
        for p in params:
            if id(p) not in where:
                raise ValueError(f"model_parameters group {gi} holds a parameter of shape {tuple(p.shape)} "
                                 f"that is not in the model")
        if not params:
            continue
        params.sort(key=lambda p: where[id(p)][0])
        halves = [(None, params)] if opt.muon is None else \
            [(use, [p for p in params if takes_muon(p, where[id(p)][1]) is use]) for use in (True, False)]
        for use_muon, half in halves:
            if half:
                hparams = opt.group_hyperparameters(g, use_muon)
                if use_muon and opt.muon.per_head_muon:      # DeepSpeed's per-head Newton-Schulz
                    hparams["muon_heads"] = attention_heads(module, [(where[id(p)][1], p) for p in half])
                groups.append(ParamGroup(half, [where[id(p)][1] for p in half], [where[id(p)][0] for p in half],
                                         hparams))
    if not groups:
        raise ValueError(f"{type(module).__name__} has no trainable parameters (none with "
                         f"requires_grad=True): there is nothing to optimize")
    return groups
