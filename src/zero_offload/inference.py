"""`InferenceEngine`: a frozen model placed as a training engine with the same config places its parameters.

What DeepSpeed builds for a reference or reward model under TRL (``prepare_deepspeed``: ``deepspeed.initialize``
without an optimizer, a ``DeepSpeedZeRoOffload`` at stage 3): at stage 3 the parameters are partitioned over the
ranks like the policy's (with ``offload_param`` the shards live on the host) and gathered module by module in
forward, prefetched in the recorded order; below stage 3 the model is whole on the device. It has no gradients,
no gradient partitions, no master weights and no optimizer state, and its `memory_breakdown` counts what it holds
(``frozen_params``, the same kind `zero_offload.estimate_memory` gives a frozen model).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_map

from zero_offload.comm import DistContext
from zero_offload.config import AutoContext, Config
from zero_offload.precision import training_dtype
from zero_offload.zero.stage3 import Stage3Optimizer

__all__ = ["InferenceEngine"]


class InferenceEngine:
    """A model none of whose parameters needs a gradient, for forward passes (and ``generate``).

    Args:
        model: the model; every parameter must have ``requires_grad=False`` (it is frozen here if it has not
            been: a reference model is never trained).
        config: a DeepSpeed-style config (dict, path or `Config`); only its ZeRO stage, ``offload_param`` and
            precision matter. No ``optimizer`` section is needed.

    Raises:
        ConfigError: an invalid config (the key named).
    """

    def __init__(self, model: torch.nn.Module, config: "Config | dict | str"):
        self.ctx = DistContext.create()
        self.config = Config.load(config, auto=AutoContext(self.ctx.world_size, model, self.ctx.device, {}))
        self.dtype = training_dtype(self.config)
        model.requires_grad_(False)
        if self.config.zero_optimization.stage == 3:
            self.module = model.to(dtype=self.dtype)
            self.zero: Stage3Optimizer | None = Stage3Optimizer(self.ctx, self.config, self.module, [], 1, self.dtype)
        else:
            self.module = model.to(device=self.ctx.device, dtype=self.dtype)
            self.zero = None
        self.module.eval()

    def __call__(self, *args, **kwargs):
        args, kwargs = tree_map(lambda x: x.to(self.ctx.device) if isinstance(x, torch.Tensor) else x,
                                (args, kwargs))
        return self.module(*args, **kwargs)

    def gathered_for_generation(self, free_bytes: int | None = None):
        """As `Engine.gathered_for_generation`: every unit gathered once where they fit."""
        return self.zero.gathered_for_generation(free_bytes) if self.zero is not None else contextlib.nullcontext(True)

    def memory_breakdown(self) -> dict[str, dict]:
        """Bytes this rank holds, by kind (``frozen_params``: this rank's shards at stage 3, the whole model
        below it; ``gathered``: units gathered now)."""
        if self.zero is not None:
            return {k: v for k, v in self.zero.memory_breakdown().items() if v["bytes"] or k == "frozen_params"}
        nbytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
        return {"frozen_params": {"bytes": nbytes, "numel": sum(p.numel() for p in self.module.parameters()),
                                  "side": "device"}}

    def close(self) -> None:
        """End the engine's threads (stage 3); the module keeps its shards."""
        if self.zero is not None:
            self.zero.close()
