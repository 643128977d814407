"""Mixed precision: the training dtype, and fp16 loss scaling as DeepSpeed's DynamicLossScaler does it."""
from __future__ import annotations

import torch

from zero_offload.config import Config

__all__ = ["training_dtype", "LossScaler", "LossScaleError"]


class LossScaleError(RuntimeError):
    """fp16 gradients overflowed with the dynamic loss scale already at ``fp16.min_loss_scale``: training cannot
    go on (DeepSpeed 0.19.8's DynamicLossScaler raises here too, with ``raise_error_at_min_scale``)."""


def training_dtype(config: Config) -> torch.dtype:
    """The dtype of the model's parameters, activations and gradients: fp16, bf16 or fp32."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[config.precision]


class LossScaler:
    """fp16 loss scale: static when ``fp16.loss_scale`` > 0, else dynamic.

    The dynamic rule is DeepSpeed 0.19.8's ``DynamicLossScaler.update_scale``, step for step: start at
    2**initial_scale_power. On an overflow the step is skipped; if ``hysteresis`` is 1 or its budget is down
    to 1 the scale is halved (never below ``min_loss_scale``; an overflow at ``min_loss_scale`` raises
    `LossScaleError`), else one unit of hysteresis is spent. A clean step doubles the scale when the number of
    clean steps since the last overflow, not counting the first one after it, is a positive multiple of
    ``loss_scale_window`` (DeepSpeed PR 6976's ``stable_interval``), and refills hysteresis then; with
    ``consecutive_hysteresis`` every clean step refills it. bf16 and fp32 use a fixed scale of 1.0 and never
    report overflows.
    """

    def __init__(self, config: Config):
        fp16 = config.fp16
        self.enabled = fp16.enabled
        self.dynamic = fp16.enabled and fp16.loss_scale == 0
        self.scale = float(2**fp16.initial_scale_power) if self.dynamic else (fp16.loss_scale or 1.0)
        self.window = fp16.loss_scale_window
        self.min_scale = fp16.min_loss_scale
        self.delayed_shift = fp16.hysteresis
        self.consecutive_hysteresis = fp16.consecutive_hysteresis
        self.hysteresis = fp16.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        """Account one optimizer step that did (or did not) overflow.

        Raises:
            LossScaleError: an overflow with the dynamic scale already at ``min_loss_scale``.
        """
        if self.dynamic:
            if overflow:
                if self.delayed_shift == 1 or self.hysteresis == 1:
                    if self.scale == self.min_scale:
                        raise LossScaleError(
                            f"fp16 gradients overflowed at step {self.iteration} with the loss scale already at "
                            f"its minimum (fp16.min_loss_scale = {self.min_scale:g}): the model diverged or "
                            f"needs bf16/fp32; lower fp16.min_loss_scale or the learning rate")
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self.hysteresis -= 1
                self.last_overflow_iteration = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.hysteresis = self.delayed_shift
                stable_interval = self.iteration - self.last_overflow_iteration - 1
                if stable_interval > 0 and stable_interval % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.hysteresis = self.delayed_shift
                    self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis": self.hysteresis, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration}

    def validate_state_dict(self, state) -> None:
        """Raise ValueError unless ``state`` is a `state_dict` of this class."""
        keys = ("scale", "hysteresis", "iteration", "last_overflow_iteration")
        if not isinstance(state, dict) or any(not isinstance(state.get(k), (int, float)) for k in keys):
            raise ValueError(f"loss scaler state must hold numbers {', '.join(keys)}, got {state!r}")

    def load_state_dict(self, state: dict) -> None:
        self.validate_state_dict(state)
        self.scale = float(state["scale"])
        self.hysteresis = int(state["hysteresis"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])


def is_overflow(norm: torch.Tensor) -> bool:
    """True when a (squared) gradient norm is inf or NaN: some gradient overflowed."""
    return not bool(torch.isfinite(norm))
