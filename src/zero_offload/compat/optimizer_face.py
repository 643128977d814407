"""The optimizer ``deepspeed.initialize`` returns: DeepSpeed's ZeRO optimizer face over the engine's optimizer.

DeepSpeed returns its ZeRO optimizer (a ``ZeROOptimizer``), not the client's; integrations read its attributes:
accelerate's ``step_was_skipped`` reads ``overflow``, OpenRLHF and TRL call ``offload_states``/``reload_states``,
logging reads ``cur_scale``/``loss_scale``. This face is also a ``torch.optim.Optimizer`` whose ``param_groups``,
``state`` and ``defaults`` are the engine optimizer's own (a torch LR scheduler built over it sets the rates the
engine steps with). Stepping goes through the engine: ``step()`` here raises.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer", "OptimizerFace"]


class DeepSpeedOptimizer:
    """Base of DeepSpeed's optimizers (``deepspeed.runtime.base_optimizer.DeepSpeedOptimizer``)."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """Base of DeepSpeed's ZeRO optimizers (``deepspeed.runtime.base_optimizer.ZeROOptimizer``)."""


class OptimizerFace(torch.optim.Optimizer, ZeROOptimizer):
    """The engine's optimizer as DeepSpeed's ZeRO optimizer.

    Attributes:
        overflow: the last boundary step was skipped (fp16 overflow, or a non-finite bf16 gradient).
        cur_scale, loss_scale: the current loss scale (1.0 without fp16).
    """

    def __init__(self, engine):        # torch's __init__ would make groups of its own: the engine's are used
        self.engine = engine
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The engine's own optimizer (DeepSpeed's ZeRO optimizer holds the client's as ``optimizer`` too)."""
        return self.engine.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    @property
    def state(self):
        return self.engine.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.engine.optimizer.defaults

    @property
    def overflow(self) -> bool:
        return self.engine.last_step_skipped

    @property
    def cur_scale(self) -> float:
        return self.engine.loss_scale

    @property
    def loss_scale(self) -> float:
        return self.engine.loss_scale

    def step(self, closure=None):
        """Raises: RuntimeError: the step is the engine's (``engine.step()`` after each ``engine.backward``)."""
        raise RuntimeError("call engine.step() (the optimizer DeepSpeed returns steps through its engine: "
                           "accumulation boundary, loss scale, clipping)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self) -> dict:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.engine.optimizer.load_state_dict(state_dict)

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False):
        self.engine.offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self.engine.reload_states(non_blocking)

    def empty_partition_cache(self) -> None:
        self.engine.zero.release_gathered()

    def __repr__(self) -> str:
        return f"OptimizerFace({type(self.engine.optimizer).__name__})"
