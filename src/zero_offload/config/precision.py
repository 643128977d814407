"""The fp16 and bf16 sections of the config, and the rules for bf16 master weights (DeepSpeed 0.19.8's
``bf16_master_weights_and_grads``: ``runtime/config.py`` and ``ZeROOptimizer._configure_master_weights``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from zero_offload.config.schema import ConfigError, option

__all__ = ["FP16Config", "BF16Config", "check_master_weights", "bf16_moments_from_optimizer"]


@dataclass
class FP16Config:
    enabled: bool = option(False, "Train with fp16 parameters, fp32 master weights and loss scaling.")
    loss_scale: float = option(0.0, "Static loss scale; 0 selects dynamic loss scaling.", min=0.0)
    initial_scale_power: int = option(16, "Dynamic scaling starts at 2**initial_scale_power.", min=0, max=64)
    loss_scale_window: int = option(1000, "Clean steps before the dynamic scale doubles.", min=1)
    hysteresis: int = option(2, "Overflows tolerated before the scale is halved.", min=1)
    consecutive_hysteresis: bool = option(False, "Refill hysteresis after every clean step (DeepSpeed's flag).")
    min_loss_scale: float = option(1.0, "The dynamic scale never drops below this.", min=0.0, min_exclusive=True)
    auto_cast: bool = option(False, "Accepted for DeepSpeed compatibility; inputs are not cast.",
                             not_implemented={True: "cast inputs yourself; the model runs in fp16"})
    fp16_master_weights_and_grads: bool = option(
        False, "DeepSpeed's fp16 master weights; master weights are always fp32 here.",
        not_implemented={True: "master weights are always fp32"})


@dataclass
class BF16Config:
    enabled: bool = option(False, "Train with bf16 parameters and fp32 master weights (no loss scaling).")
    check_grad_overflow: bool = option(True, "Skip the optimizer step when the gradient norm is not finite "
                                             "(DeepSpeed 0.19.8's default, true).")
    immediate_grad_update: bool = option(False, "DeepSpeed's bf16 optimizer switch; gradients always go "
                                                "straight to their partition here (no effect).")
    bf16_master_weights_and_grads: bool = option(
        False, "DeepSpeed's bf16 master weights and gradient partitions: the host step widens each bf16 master "
               "to fp32, updates it and rounds it back (master_weights_rounding), and gradients accumulate in "
               "bf16; 2 + 2 bytes/param of host memory less. Changes what is trained: only where asked.")
    bf16_optimizer_states: bool = option(False, "Keep the Adam moments in bf16 on the host or in NVMe files "
                                                "(DeepSpeed PR 8010): 4 bytes/param less, with "
                                                "offload_optimizer.device 'cpu' or 'nvme' (no effect on an "
                                                "accelerator's own states); unlike DeepSpeed, "
                                                "bf16_master_weights_and_grads is not required.")
    master_weights_rounding: Literal["nearest", "stochastic"] = option(
        "nearest", "Not a DeepSpeed key: how a bf16 master is rounded after its update; 'nearest' (nearest-even, "
                   "DeepSpeed's) or 'stochastic' (unbiased: an update below half a bf16 ulp still moves the weight "
                   "on average). Needs bf16_master_weights_and_grads.")

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the master weights and of accumulated gradient partitions: bf16 under
        ``bf16_master_weights_and_grads``, else fp32."""
        return torch.bfloat16 if self.bf16_master_weights_and_grads else torch.float32

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype of the Adam moments where the host keeps them (memory or NVMe): bf16 under
        ``bf16_optimizer_states``, else fp32."""
        return torch.bfloat16 if self.bf16_optimizer_states else torch.float32


def bf16_moments_from_optimizer(cfg) -> None:
    """DeepSpeed's ``optimizer.params.fp32_optimizer_states: false`` (its CPU Adam keeps the moments in the
    parameters' dtype) is ``bf16.bf16_optimizer_states`` here: set it, so one key says what the moments are.
    ``cfg``: the `zero_offload.config.Config` being validated (its sections import this module).

    Raises:
        ConfigError: without bf16 training (fp16 moments are not built).
    """
    opt = cfg.optimizer
    if opt is None or opt.torch_kwargs is not None or opt.params.fp32_optimizer_states:
        return
    if not cfg.bf16.enabled:
        raise ConfigError("config key 'optimizer.params.fp32_optimizer_states' = false keeps the moments in the "
                          "parameters' dtype: built for bf16 ('bf16.enabled' = true), not fp16 or fp32")
    cfg.bf16.bf16_optimizer_states = True


def check_master_weights(cfg) -> None:
    """Refuse a bf16 master-weight setting this engine does not build, naming the keys; ``cfg``: the
    `zero_offload.config.Config` being validated (its sections import this module).

    Mirrors DeepSpeed 0.19.8: bf16 masters only with ``bf16.enabled`` at ZeRO stages 1-3 and with its CPU Adam
    (here: Adam/AdamW on the fused host kernel). Not built yet: parameters on NVMe,
    ``offload_optimizer.ratio`` < 1.

    Raises:
        ConfigError: one of the above, or ``bf16.master_weights_rounding`` = 'stochastic' without bf16 masters.
    """
    bf16 = cfg.bf16
    key = "config key 'bf16.bf16_master_weights_and_grads' = true"
    if not bf16.bf16_master_weights_and_grads:
        if bf16.master_weights_rounding != "nearest":
            raise ConfigError(f"config key 'bf16.master_weights_rounding' = {bf16.master_weights_rounding!r} needs "
                              "'bf16.bf16_master_weights_and_grads' = true: fp32 masters are not rounded")
        return
    zc = cfg.zero_optimization
    oo = zc.offload_optimizer
    if not bf16.enabled:
        raise ConfigError(f"{key} needs 'bf16.enabled' = true")
    if zc.stage < 1:
        raise ConfigError(f"{key} needs 'zero_optimization.stage' 1, 2 or 3 (got 0), as in DeepSpeed")
    opt = cfg.optimizer
    if opt is not None and (opt.torch_kwargs is not None or opt.params.amsgrad):
        raise ConfigError(f"{key} needs optimizer type Adam/AdamW without amsgrad (got {opt.type!r}): only the fused "
                          "host kernel steps bf16 masters (DeepSpeed: DeepSpeedCPUAdam)")
    unbuilt = [("zero_optimization.offload_param.device", zc.offload_param.device == "nvme", "'nvme'"),
               ("zero_optimization.offload_optimizer.ratio", oo.ratio < 1.0, str(oo.ratio))]
    for other, on, value in unbuilt:
        if on:
            raise ConfigError(f"{key} and '{other}' = {value} do not combine yet: bf16 masters are built for the "
                              "host step of states in host memory or NVMe, of parameters in memory")
