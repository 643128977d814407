"""Client optimizers and schedulers handed to ``deepspeed.initialize``, mapped onto zero-offload's engine.

A ``torch.optim`` optimizer becomes the config's ``optimizer`` section plus param groups: Adam/AdamW keep
their hyper-parameters on the fused host kernel (torch's Adam ``weight_decay`` is L2, so ``adam_w_mode`` is
false; ``amsgrad`` runs torch's AMSGrad on the partition); any other torch.optim class runs as itself on
this rank's partition. DeepSpeed's own classes as the compat layer names them (`zero_offload.compat.ops`:
``DeepSpeedCPUAdam``, ``FusedLamb``) become Adam/AdamW (by their ``adamw_mode``) and Lamb. With
``offload_optimizer`` set the Adam family runs on the host kernel, where DeepSpeed 0.19.8 refuses a client
optimizer other than its DeepSpeedCPUAdam unless ``zero_force_ds_cpu_optimizer`` is false (the update is the
same). The engine's optimizer then owns the live learning rates, so a client scheduler's
rates are copied into it after every step.
"""
from __future__ import annotations

import inspect
import warnings

import torch

from zero_offload.compat.ops.adagrad import DeepSpeedCPUAdagrad
from zero_offload.compat.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zero_offload.compat.muon_client import is_torch_muon, torch_muon_config
from zero_offload.compat.ops.lamb import FusedLamb

__all__ = ["client_optimizer_config", "ClientScheduler"]

_PER_GROUP = ("lr", "betas", "eps", "weight_decay")


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def client_optimizer_config(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> tuple[dict, list]:
    """(the config's ``optimizer`` section, model_parameters groups) equivalent to ``optimizer``.

    Raises:
        ValueError: an optimizer that is not a ``torch.optim`` class (its step cannot run on the partitions).
    """
    if is_torch_muon(optimizer):
        return torch_muon_config(optimizer, model)
    cls = torch.optim.Adagrad if isinstance(optimizer, DeepSpeedCPUAdagrad) else type(optimizer)
    if isinstance(optimizer, (DeepSpeedCPUAdam, FusedAdam, FusedLamb)):
        return _deepspeed_class_config(optimizer)
    if getattr(torch.optim, cls.__name__, None) is not cls:
        raise ValueError(f"client optimizer {cls.__module__}.{cls.__name__} is not a torch.optim optimizer: "
                         f"zero-offload steps partitions with its own Adam or a torch.optim class; pass "
                         f"torch.optim.AdamW (or another torch.optim optimizer) or set the config's 'optimizer'")
    d = optimizer.defaults
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        params = {"lr": _plain(d["lr"]), "betas": _plain(d["betas"]), "eps": d["eps"],
                  "weight_decay": d["weight_decay"], "adam_w_mode": cls is torch.optim.AdamW,
                  "amsgrad": bool(d.get("amsgrad", False))}
        section = {"type": cls.__name__, "params": params}
    else:
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        section = {"type": cls.__name__, "params": {k: _plain(v) for k, v in d.items() if k in accepted}}
    groups = [{"params": list(g["params"]), **{k: _plain(g[k]) for k in _PER_GROUP if k in g}}
              for g in optimizer.param_groups]
    return section, groups


def _deepspeed_class_config(optimizer) -> tuple[dict, list]:
    """DeepSpeedCPUAdam or FusedLamb: its defaults as the section, its groups (lr, betas, eps, weight_decay per
    group); the keys the engine keeps once per optimizer must agree between groups."""
    d = optimizer.defaults
    if isinstance(optimizer, (DeepSpeedCPUAdam, FusedAdam)):
        once = ("bias_correction",)
        params = {"lr": d["lr"], "betas": _plain(d["betas"]), "eps": d["eps"], "weight_decay": d["weight_decay"],
                  "adam_w_mode": optimizer.adam_w_mode, "bias_correction": d["bias_correction"]}
        if getattr(optimizer, "defaults", {}).get("amsgrad"):
            params["amsgrad"] = True
        section = {"type": "AdamW" if optimizer.adam_w_mode else "Adam", "params": params}
    else:
        once = ("bias_correction", "eps_inside_sqrt", "max_coeff", "min_coeff")
        params = {k: _plain(d[k]) for k in ("lr", "betas", "eps", "weight_decay", *once)}
        section = {"type": "Lamb", "params": params}
    for i, g in enumerate(optimizer.param_groups):
        for key in once:
            if g[key] != d[key]:
                raise ValueError(f"client optimizer {type(optimizer).__name__}: param group {i} sets {key}="
                                 f"{g[key]!r}, the others {d[key]!r}; per group only lr, betas, eps and "
                                 f"weight_decay may differ")
    groups = [{"params": list(g["params"]), **{k: _plain(g[k]) for k in _PER_GROUP}}
              for g in optimizer.param_groups]
    return section, groups


class ClientScheduler:
    """A client LR scheduler stepped by the engine; its rates are copied into the engine's optimizer.

    Attributes:
        scheduler: the client's scheduler (``get_last_lr()``, ``state_dict()`` reach it).
    """

    def __init__(self, scheduler, engine_optimizer: torch.optim.Optimizer):
        self.scheduler, self.target = scheduler, engine_optimizer
        self._copy()

    def _copy(self) -> None:
        source = getattr(self.scheduler, "optimizer", None)
        if source is None:
            return
        groups = source.param_groups
        for i, g in enumerate(self.target.param_groups):
            src = groups[min(i, len(groups) - 1)]
            g["lr"] = _plain(src["lr"])
            if "betas" in src and "betas" in g:
                g["betas"] = tuple(_plain(src["betas"]))

    def step(self, *args, **kwargs) -> None:
        with warnings.catch_warnings():     # torch warns when its optimizer.step was not the one called
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step(*args, **kwargs)
        self._copy()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        self._copy()

    def __getattr__(self, name):
        return getattr(self.__dict__["scheduler"], name)
