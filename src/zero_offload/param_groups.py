"""`param_groups`: the engine's param groups from a model and ``model_parameters``, as ``deepspeed.initialize`` takes
them (parameters, or param-group dicts with their own hyper-parameters)."""
from __future__ import annotations

import torch

from zero_offload.zero import ParamGroup

__all__ = ["param_groups"]


def param_groups(module: torch.nn.Module, model_parameters, opt) -> list[ParamGroup]:
    """The trainable parameters of ``module`` in groups, each in model order with its names, positions and
    hyper-parameters (``opt.group_hyperparameters``: the config's optimizer params overridden by the group's keys).
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
        groups.append(ParamGroup(params, [where[id(p)][1] for p in params], [where[id(p)][0] for p in params],
                                 opt.group_hyperparameters(g)))
    if not groups:
        raise ValueError(f"{type(module).__name__} has no trainable parameters (none with "
                         f"requires_grad=True): there is nothing to optimize")
    return groups
