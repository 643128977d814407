"""`StepPolicy`: when the host step runs relative to training, decided once from the config.

- ``SYNCHRONOUS``: at the boundary, on the training thread, every core (the plain ZeRO-Offload step).
- ``DELAYED``: ``offload_optimizer.delayed_param_update``: one step behind, beside the next forward and backward
  (ZeRO-Offload paper, Sec. 5.2; `zero_offload.hoststep.delayed`). Changes what is trained: a stale step.
- ``SPECULATIVE``: ``offload_optimizer.super_offload``: during the boundary backward, kept or redone exactly once
  the global norm is known (`zero_offload.hoststep.speculation`).

Only the builder (for the partition optimizers' layout) and the pipeline (the boundary) read the config for it.
"""
from __future__ import annotations

import enum

__all__ = ["StepPolicy"]


class StepPolicy(enum.Enum):
    SYNCHRONOUS = "synchronous"
    DELAYED = "delayed"
    SPECULATIVE = "speculative"

    @classmethod
    def from_config(cls, config) -> "StepPolicy":
        """The policy ``config.zero_optimization.offload_optimizer`` asks for (the config refuses both keys)."""
        oo = config.zero_optimization.offload_optimizer
        if oo.delayed_param_update:
            return cls.DELAYED
        return cls.SPECULATIVE if oo.super_offload else cls.SYNCHRONOUS

    @property
    def beside_training(self) -> bool:
        """The step runs on its own thread while training goes on, on the ``cpuadam_cores_perc`` share of the
        cores; a synchronous one takes every core, the training thread waiting for it."""
        return self is not StepPolicy.SYNCHRONOUS
