"""Any torch optimizer over this rank's partition, for the settings the fused Adam kernel does not cover.

DeepSpeed runs ``getattr(torch.optim, optimizer.type)(params, **optimizer.params)`` for a type it has no
kernel of its own for, and torch's Adam for ``amsgrad``; here that optimizer steps the fp32 master
partition (on the host when offloaded), exactly as `PartitionedAdam` steps it with the fused kernel, and the
updated 16-bit partition is written back the same way.
"""
from __future__ import annotations

import torch

from zero_offload.config_schema import ConfigError
from zero_offload.offload.copies import Copies
from zero_offload.zero.grad_partition import GradSource
from zero_offload.zero.partitioned_adam import PartitionedAdam, host_state_dtype

__all__ = ["PartitionedTorchOptimizer", "partitioned_optimizer"]


def partitioned_optimizer(config, parts: list[torch.Tensor], hparams: list[dict], offload: bool,
                          copies: Copies, host_params: bool = False) -> PartitionedAdam:
    """The partitioned optimizer ``config.optimizer`` asks for: the fused Adam kernel for Adam/AdamW, a torch
    optimizer on the partition for ``amsgrad`` and for torch.optim types.

    Raises:
        ConfigError: ``offload_optimizer.delayed_param_update`` with a torch optimizer (only the fused
            kernel's step runs in the background).
    """
    opt = config.optimizer
    deferred = config.zero_optimization.offload_optimizer.delayed_param_update
    if opt.torch_kwargs is None and not opt.params.amsgrad:
        return PartitionedAdam(parts, hparams, offload, copies, host_params=host_params, deferred=deferred,
                               state_dtype=host_state_dtype(config))
    if deferred:
        raise ConfigError("config key 'zero_optimization.offload_optimizer.delayed_param_update' = true needs "
                          f"optimizer type Adam/AdamW without amsgrad (got {opt.type!r}): only the fused host "
                          "kernel's step runs in the background")
    return PartitionedTorchOptimizer(parts, hparams, offload, copies, host_params=host_params,
                                     type_name=opt.type, torch_kwargs=opt.torch_kwargs)


class PartitionedTorchOptimizer(PartitionedAdam):
    """`PartitionedAdam`'s partition, masters and write-back, stepped by a torch optimizer.

    Args:
        type_name: ``Adam``/``AdamW`` (then with ``amsgrad=True``) or a torch.optim class name.
        torch_kwargs: the config's ``optimizer.params`` for a torch.optim type (None for Adam/AdamW); each
            group's ``lr`` (and ``weight_decay``) come from ``hparams``, so per-group values and the LR
            schedule apply.
    """

    def __init__(self, parts, hparams, offload, copies, host_params=False, *, type_name: str,
                 torch_kwargs: dict | None):
        super().__init__(parts, hparams, offload, copies, host_params=host_params)
        self.type_name = type_name
        groups = []
        for master, h in zip(self.masters, hparams):
            if torch_kwargs is None:
                cls = torch.optim.AdamW if h["adamw_mode"] else torch.optim.Adam
                groups.append(dict(params=[master], lr=h["lr"], betas=h["betas"], eps=h["eps"],
                                   weight_decay=h["weight_decay"], amsgrad=True))
            else:
                cls = getattr(torch.optim, type_name)
                group = dict(torch_kwargs, params=[master], lr=h["lr"])
                if "weight_decay" in torch_kwargs or h["weight_decay"]:
                    group["weight_decay"] = h["weight_decay"]
                groups.append(group)
        self.optimizer = cls(groups)

    @torch.no_grad()
    def step(self, grads: list[GradSource], grad_scale: float, lrs=None, publish: bool = True) -> None:
        """One torch-optimizer step of every group's master partition with ``grads`` (waited for) x
        ``grad_scale``; the updated values are copied into the 16-bit (or fp32) partition."""
        for master, g in zip(self.masters, grads):
            master.grad = g.ready().to(master.device, torch.float32, copy=True).mul_(grad_scale)
        self.optimizer.step()
        for part, master in zip(self.parts, self.masters):
            master.grad = None
            if master.data_ptr() != part.data_ptr():
                part.copy_(master)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Master partitions and the optimizer's per-element states (first-moment-like under ``exp_avg``,
        the rest under ``exp_avg_sq``), for memory accounting."""
        first, rest = [], []
        for m in self.masters:
            for name, t in self.optimizer.state.get(m, {}).items():
                if isinstance(t, torch.Tensor) and t.numel() == m.numel():
                    (first if name in ("exp_avg", "momentum_buffer") else rest).append(t)
        return {"master": self.masters, "exp_avg": first, "exp_avg_sq": rest}

    def state_chunks(self, g: int, chunk_numel: int = 1 << 24):
        raise NotImplementedError(
            f"checkpoints of optimizer type {self.type_name!r} (or amsgrad) are not built: only the fused Adam/"
            f"AdamW states are saved. Save with optimizer type Adam/AdamW, or save the model with "
            f"engine.save_16bit_model / engine.full_state_dict()")

    def load_state_chunks(self, g: int, step: int, chunks) -> None:
        self.state_chunks(g)
