"""DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest, stepped per optimizer step.

Formulas and the step-0 behaviour mirror ``deepspeed.runtime.lr_schedules``: the optimizer's lr is set at
construction (WarmupLR: ``warmup_min_lr``; WarmupCosineLR: 0), each ``step()`` advances
``last_batch_iteration`` and writes the new rate into every param group, and the engine does not step the
schedule on a skipped (fp16 overflow) step.
"""
from __future__ import annotations

import math

import torch

from zero_offload.config import (LRRangeTestParams, OneCycleParams, SchedulerConfig, WarmupCosineLRParams,
                                 WarmupDecayLRParams, WarmupLRParams)

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "build_scheduler"]


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
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (log or linear), then hold.

    Without ``warmup_max_lr`` each param group warms up to its own lr, as DeepSpeed 0.19.8's WarmupLR does.
    """

    def __init__(self, optimizer, p: WarmupLRParams):
        super().__init__(optimizer)
        self.min_lr = p.warmup_min_lr
        self.max_lrs = [g["lr"] if p.warmup_max_lr is None else p.warmup_max_lr for g in optimizer.param_groups]
        self.warmup_steps = max(2, p.warmup_num_steps)  # log(1) would divide by zero
        self.warmup_type = p.warmup_type
        self._apply()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [self.min_lr for _ in self.max_lrs]
        gamma = self._gamma()
        return [self.min_lr + (max_lr - self.min_lr) * gamma for max_lr in self.max_lrs]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "max_lrs": list(self.max_lrs)}

    def load_state_dict(self, state: dict) -> None:
        self.max_lrs = list(state.get("max_lrs", self.max_lrs))
        super().load_state_dict(state)


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


class LRRangeTest(_Schedule):
    """lr = min_lr x (1 + step_rate x interval), interval = (iteration + 1) / step_size (floored when
    ``lr_range_test_staircase``): DeepSpeed's LR range test (Smith, 2017)."""

    def __init__(self, optimizer, p: LRRangeTestParams):
        super().__init__(optimizer)
        self.min_lr, self.step_size, self.step_rate = p.lr_range_test_min_lr, p.lr_range_test_step_size, \
            p.lr_range_test_step_rate
        self.staircase = p.lr_range_test_staircase
        for group in optimizer.param_groups:     # DeepSpeed sets min_lr at construction
            group["lr"] = self.min_lr

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [self.min_lr * (1 + self.step_rate * interval) for _ in self.optimizer.param_groups]


class OneCycle(_Schedule):
    """DeepSpeed's 1Cycle: lr rises from cycle_min_lr to cycle_max_lr over cycle_first_step_size steps,
    falls back over cycle_second_step_size, then decays; beta1 cycles the other way when
    ``cycle_momentum`` (and beta2 is set to 0.99, as DeepSpeed does)."""

    def __init__(self, optimizer, p: OneCycleParams):
        super().__init__(optimizer)
        first = float(p.cycle_first_step_size)
        second = float(p.cycle_second_step_size) if p.cycle_second_step_size is not None else first
        self.total_size, self.first_step_size, self.second_step_size = first + second, first, second
        self.step_ratio = first / self.total_size
        self.first_stair_count = p.cycle_first_stair_count
        self.second_stair_count = (p.cycle_first_stair_count if p.cycle_second_stair_count is None
                                   else p.cycle_second_stair_count)
        self.decay_step_size = p.decay_step_size
        self.min_lr, self.max_lr, self.decay_lr_rate = p.cycle_min_lr, p.cycle_max_lr, p.decay_lr_rate
        self.skip_lr_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(self.decay_step_size, 0) or math.isclose(p.decay_mom_rate, 0)
        self.cycle_momentum = p.cycle_momentum and "betas" in optimizer.param_groups[0]
        self.min_mom, self.max_mom, self.decay_mom_rate = p.cycle_min_mom, p.cycle_max_mom, p.decay_mom_rate
        for group in optimizer.param_groups:
            group["lr"] = self.min_lr
            if self.cycle_momentum:
                group["betas"] = (self.min_mom, 0.99)

    def _scale_factor(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            cycle_it = it % self.total_size
            if cycle_it <= self.first_step_size:
                position = cycle_it * stairs / self.first_step_size
            else:
                position = (self.total_size - cycle_it) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self._scale_factor()
        elif self.skip_lr_decay:
            lr = self.min_lr
        else:
            interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
            lr = self.min_lr / (1 + self.decay_lr_rate * interval)
        return [lr for _ in self.optimizer.param_groups]

    def get_mom(self) -> float:
        if self.last_batch_iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale_factor()
        if self.skip_mom_decay:
            return self.max_mom
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return self.max_mom * (1 + self.decay_mom_rate * interval)

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum and self.last_batch_iteration >= 0:
            for group in self.optimizer.param_groups:
                group["betas"] = (self.get_mom(), 0.99)


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
             "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def build_scheduler(config: SchedulerConfig | None, optimizer: torch.optim.Optimizer):
    """The schedule named by the config's ``scheduler.type``, or None when no scheduler is configured."""
    if config is None:
        return None
    return SCHEDULES[config.type](optimizer, config.params)
