"""DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, stepped once per optimizer step.

Formulas and the step-0 behaviour mirror ``deepspeed.runtime.lr_schedules``: the optimizer's lr is set at
construction (WarmupLR: ``warmup_min_lr``; WarmupCosineLR: 0), each ``step()`` advances
``last_batch_iteration`` and writes the new rate into every param group, and the engine does not step the
schedule on a skipped (fp16 overflow) step.
"""
from __future__ import annotations

import math

import torch

from zero_offload.config import SchedulerConfig, WarmupCosineLRParams, WarmupDecayLRParams, WarmupLRParams

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_scheduler"]


def _warmup_gamma(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


class _Schedule:
    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.last_batch_iteration = -1

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self) -> None:
        self.last_batch_iteration += 1
        self._apply()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()


class WarmupLR(_Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (log or linear), then hold."""

    def __init__(self, optimizer, p: WarmupLRParams):
        super().__init__(optimizer)
        self.min_lr, self.max_lr = p.warmup_min_lr, p.warmup_max_lr
        self.warmup_steps = max(2, p.warmup_num_steps)  # log(1) would divide by zero
        self.warmup_type = p.warmup_type
        self._apply()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            lr = self.min_lr
        else:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self._gamma()
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer, p: WarmupDecayLRParams):
        self.total_steps = p.total_num_steps
        super().__init__(optimizer, p)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_steps, self.warmup_type)
        return max(0.0, (self.total_steps - self.last_batch_iteration)
                   / max(1.0, self.total_steps - self.warmup_steps))


class WarmupCosineLR(_Schedule):
    """Warm up to the optimizer's lr as a ratio, then cosine decay to ``cos_min_ratio`` x lr."""

    def __init__(self, optimizer, p: WarmupCosineLRParams):
        super().__init__(optimizer)
        self.total_steps = p.total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = p.warmup_min_ratio, p.cos_min_ratio
        self.warmup_steps = max(2, p.warmup_num_steps)
        self.warmup_type = p.warmup_type
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self._apply()

    def _ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_steps:
            r = _warmup_gamma(it, self.warmup_steps, self.warmup_type)
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_steps + 1) / max(1, self.total_steps - self.warmup_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self) -> list[float]:
        ratio = self._ratio()
        return [lr * ratio for lr in self.base_lrs]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict) -> None:
        self.base_lrs = list(state.get("base_lrs", self.base_lrs))
        super().load_state_dict(state)


def build_scheduler(config: SchedulerConfig | None, optimizer: torch.optim.Optimizer):
    """The schedule named by the config's ``scheduler.type``, or None when no scheduler is configured."""
    if config is None:
        return None
    cls = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}[config.type]
    return cls(optimizer, config.params)
