"""The optimizer and learning-rate schedule sections of the config (`OptimizerConfig`, `SchedulerConfig`).

Keys, defaults and rules mirror DeepSpeed 0.19.8 (``deepspeed/runtime/engine.py::_configure_basic_optimizer``,
``deepspeed/runtime/lr_schedules.py``).
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from zero_offload.config.schema import ConfigError, from_dict, option

__all__ = ["AdamParams", "LambParams", "MuonParams", "check_muon", "muon_clips_update", "check_fused_kernel_keys", "OptimizerConfig",
           "SchedulerConfig", "WarmupLRParams", "WarmupDecayLRParams", "WarmupCosineLRParams", "OneCycleParams",
           "LRRangeTestParams", "SCHEDULER_PARAMS", "REFUSED_OPTIMIZERS"]


@dataclass
class AdamParams:
    lr: float = option(1e-3, "Learning rate (the schedule's max when a scheduler sets it).", min=0.0)
    betas: tuple[float, float] = option((0.9, 0.999), "Adam's (beta1, beta2).")
    eps: float = option(1e-8, "Added to the denominator for numerical stability.", min=0.0)
    weight_decay: float = option(0.0, "Decoupled (AdamW) or L2 (Adam) weight decay.", min=0.0)
    adam_w_mode: bool = option(True, "Decoupled weight decay (AdamW); false adds L2 decay to the gradient.")
    bias_correction: bool = option(True, "Adam's bias correction of both moments.")
    torch_adam: bool = option(False, "Accepted for DeepSpeed compatibility; the host kernel is always ours.")
    amsgrad: bool = option(False, "AMSGrad (keep the running max of exp_avg_sq): the step then runs "
                                  "torch.optim.Adam/AdamW(amsgrad=True) on this rank's partition.")
    fp32_optimizer_states: bool = option(True, "DeepSpeed's switch for the CPU Adam's moments: false keeps them "
                                               "in the parameters' precision, bf16 here (as "
                                               "bf16.bf16_optimizer_states; needs bf16 training).")

    def validate(self, path):
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ConfigError(f"config key '{path}.betas[{i}]': got {b!r}, must be in [0, 1)")
        if self.amsgrad and not self.bias_correction:
            raise ConfigError(f"config key '{path}.amsgrad' = true needs '{path}.bias_correction' = true "
                              f"(torch's AMSGrad always corrects bias)")


@dataclass
class LambParams:
    """DeepSpeed's ``FusedLamb`` arguments (``optimizer.type: "Lamb"``); see `zero_offload.optim.lamb`."""
    lr: float = option(1e-3, "Learning rate (the schedule's max when a scheduler sets it).", min=0.0)
    betas: tuple[float, float] = option((0.9, 0.999), "LAMB's (beta1, beta2).")
    eps: float = option(1e-8, "Added to sqrt(v) (or to v with eps_inside_sqrt).", min=0.0)
    weight_decay: float = option(0.0, "Added to the update before the trust ratio (weight_decay x p).", min=0.0)
    bias_correction: bool = option(True, "Scale the step by sqrt(1 - beta2^t) / (1 - beta1^t).")
    eps_inside_sqrt: bool = option(False, "Divide by sqrt(v + eps) instead of sqrt(v) + eps.")
    max_coeff: float = option(10.0, "Upper clamp of the trust ratio ||p|| / ||update||.", min=0.0)
    min_coeff: float = option(0.01, "Lower clamp of the trust ratio.", min=0.0)
    amsgrad: bool = option(False, "Not supported by LAMB (DeepSpeed's FusedLamb raises too).",
                           not_implemented={True: "LAMB has no AMSGrad variant"})

    def validate(self, path):
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ConfigError(f"config key '{path}.betas[{i}]': got {b!r}, must be in [0, 1)")
        if self.min_coeff > self.max_coeff:
            raise ConfigError(f"config key '{path}.min_coeff': got {self.min_coeff!r}, must be <= "
                              f"'{path}.max_coeff' ({self.max_coeff!r})")


@dataclass
class MuonParams:
    """DeepSpeed 0.19.8's ``"optimizer": {"type": "Muon"}`` params (``DeepSpeedEngine._muon_param_groups``): Muon
    for the matrices, AdamW for the rest, each half with its own settings. A key left out takes the value of
    DeepSpeed's ``MuonWithAuxAdam`` (Muon lr 0.02, momentum 0.95; Adam lr 3e-4, betas (0.9, 0.95), eps 1e-10;
    weight decay 0). ``flavor: "torch"`` and the ``ns_*``/``nesterov``/``adjust_lr_fn`` keys are ours:
    ``torch.optim.Muon``'s definition (`zero_offload.optim.muon`)."""
    lr: float | None = option(None, "Both halves' learning rate (muon_lr / adam_lr override it).", min=0.0)
    muon_lr: float | None = option(None, "The Muon half's learning rate.", min=0.0)
    adam_lr: float | None = option(None, "The Adam half's learning rate.", min=0.0)
    momentum: float | None = option(None, "Muon's momentum (default 0.95).", min=0.0, max=1.0)
    weight_decay: float | None = option(None, "Decoupled weight decay of both halves (default 0).", min=0.0)
    ns_method: Literal["gram", "standard"] | None = option(None, "DeepSpeed's Newton-Schulz: 'gram' (default: "
                                                                 "fp16 Gram iteration) or 'standard' (bf16).")
    betas: tuple[float, float] | None = option(None, "The Adam half's (beta1, beta2) (default (0.9, 0.95)).")
    eps: float | None = option(None, "The Adam half's eps (default 1e-10).", min=0.0)
    adam_w_mode: bool = option(True, "The Adam half's decay is decoupled (AdamW); false: L2.")
    per_head_muon: bool = option(False, "Orthogonalize each attention head's rows of q/k/v on their own "
                                        "(DeepSpeed's per_head_muon).")
    flavor: Literal["deepspeed", "torch"] = option("deepspeed", "Whose Muon: DeepSpeed's, or torch.optim.Muon's "
                                                                "(Nesterov optional, bf16 addmm iteration, lr "
                                                                "adjusted by shape).")
    nesterov: bool = option(True, "torch flavor: Nesterov momentum.")
    ns_steps: int = option(5, "Newton-Schulz iterations.", min=1, max=99)
    ns_coefficients: tuple[float, float, float] = option((3.4445, -4.775, 2.0315),
                                                         "torch flavor: the quintic's (a, b, c).")
    ns_eps: float = option(1e-7, "torch flavor: the norm's lower clamp.", min=0.0)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = option(None, "torch flavor: the learning rate's "
                                                                              "scale by shape.")
    clip: Literal["update", "gradient"] | None = option(
        None, "What gradient_clipping clips for the Muon half: 'update' (DeepSpeed 0.19.8's ZeRO stages 1-3: the "
              "orthogonalized update, together with the AdamW half's gradients, in one global norm) or 'gradient' "
              "(the raw gradient before the momentum, as MuonWithAuxAdam alone and torch.optim.Muon with "
              "clip_grad_norm_). Default: 'update' for flavor deepspeed at stages 1-3 with the states in memory, "
              "else 'gradient'.")

    def validate(self, path):
        for i, b in enumerate(self.betas or ()):
            if not 0.0 <= b < 1.0:
                raise ConfigError(f"config key '{path}.betas[{i}]': got {b!r}, must be in [0, 1)")
        if self.flavor == "torch" and self.ns_method is not None:
            raise ConfigError(f"config key '{path}.ns_method' = {self.ns_method!r} is DeepSpeed's; flavor 'torch' "
                              f"runs torch.optim.Muon's iteration (ns_coefficients, ns_steps, ns_eps)")

    def half(self, use_muon: bool, group: dict) -> dict:
        """One half's hyper-parameters (DeepSpeed's resolution, most specific last: MuonWithAuxAdam's default, the
        shared key, muon_lr / adam_lr, then the param group's own ``group`` keys)."""
        if use_muon:
            keys = dict(lr=0.02, momentum=0.95, weight_decay=0.0, ns_method="gram")
            override = self.muon_lr
        else:
            keys = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
            override = self.adam_lr
        out = {k: getattr(self, k) if getattr(self, k) is not None else v for k, v in keys.items()}
        if override is not None:
            out["lr"] = override
        out.update({k: group[k] for k in keys if k in group})
        if use_muon:
            # betas and eps too: the Muon group sits among the Adam kernel's groups, which never step it
            out.update(use_muon=True, flavor=self.flavor, nesterov=self.nesterov, ns_steps=self.ns_steps,
                       ns_coefficients=tuple(self.ns_coefficients), ns_eps=self.ns_eps, adjust_lr_fn=self.adjust_lr_fn,
                       betas=(0.9, 0.95), eps=1e-10)
            if self.flavor == "torch":
                out["ns_method"] = "torch"
        else:
            out["betas"] = tuple(out["betas"])
            out["use_muon"] = False
        return dict(out, adamw_mode=self.adam_w_mode, bias_correction=True)


def muon_clips_update(config) -> bool:
    """Whether ``gradient_clipping`` (and the reported gradient norm) covers the Muon half's orthogonalized update
    (DeepSpeed 0.19.8's ZeRO order) rather than its raw gradient (`MuonParams.clip`)."""
    opt = config.optimizer
    if opt is None or opt.muon is None:
        return False
    if opt.muon.clip is not None:
        return opt.muon.clip == "update"
    zc = config.zero_optimization
    return (opt.muon.flavor == "deepspeed" and zc.stage >= 1 and zc.offload_optimizer.device != "nvme")


def check_muon(config) -> None:
    """Optimizer type Muon with a setting it is not built with: refused, naming the key and why.

    Raises:
        ConfigError: ``ratio`` < 1, the delayed update, ``super_offload``, bf16 masters, gradients on the
            device, or bf16 optimizer states in swap files with type Muon; ``clip: "update"`` with the torch flavor
            or with the states in swap files.
    """
    opt = config.optimizer
    if opt is None or opt.muon is None:
        return
    zc = config.zero_optimization
    oo = zc.offload_optimizer
    if opt.muon.clip is None and opt.muon.flavor == "deepspeed" and zc.stage >= 1 and oo.device == "nvme" \
            and config.gradient_clipping > 0:
        warnings.warn("optimizer type 'Muon' with offload_optimizer.device 'nvme': gradient_clipping clips the Muon "
                      "half's raw gradient ('optimizer.params.clip': 'gradient'); DeepSpeed 0.19.8 clips the "
                      "orthogonalized update, which is not built for states in swap files", stacklevel=3)
    refusals = (
        (opt.muon.clip == "update" and opt.muon.flavor == "torch", "optimizer.params.clip", "'update'",
         "the torch flavor is torch.optim.Muon's definition, which clips the gradient (clip: 'gradient')"),
        (opt.muon.clip == "update" and oo.device == "nvme", "optimizer.params.clip", "'update'",
         "the orthogonalized update is clipped in memory; with offload_optimizer.device 'nvme' use 'gradient'"),
        (oo.device == "nvme" and config.bf16.bf16_optimizer_states, "bf16.bf16_optimizer_states", "true",
         "with offload_optimizer.device 'nvme' every state file of a Muon run is fp32 (Muon's momentum is)"),
        (oo.ratio < 1.0, "zero_optimization.offload_optimizer.ratio", str(oo.ratio),
         "each Muon matrix is stepped whole by its owner's exchange, not split between device and host"),
        (oo.delayed_param_update, "zero_optimization.offload_optimizer.delayed_param_update", "true",
         "the owners' exchanges are collectives of the training thread's step, which the delayed update runs "
         "beside the next forward"),
        (oo.super_offload, "zero_optimization.offload_optimizer.super_offload", "true",
         "a matrix is orthogonalized only once all of its gradient is reduced, so no piece can be stepped "
         "while backward runs"),
        (config.bf16.bf16_master_weights_and_grads, "bf16.bf16_master_weights_and_grads", "true",
         "Muon steps fp32 masters"),
        (oo.gradients_on_device, "zero_optimization.offload_optimizer.gradients_on_device", "true",
         "Muon orthogonalizes whole matrices from gradients in host memory"),
    )
    for on, key, value, why in refusals:
        if on:
            raise ConfigError(f"config key '{key}' = {value} with optimizer type 'Muon' is not built: {why}")


def check_fused_kernel_keys(config) -> None:
    """``offload_optimizer.gradients_on_device`` with an optimizer the fused host kernel does not run (amsgrad, Lamb,
    a torch.optim type): refused when the config loads, so the planner never offers it (Muon: `check_muon`).

    Raises:
        ConfigError: naming the key and the optimizer type.
    """
    opt = config.optimizer
    amsgrad = opt is not None and getattr(opt.params, "amsgrad", False)
    if (config.zero_optimization.offload_optimizer.gradients_on_device and opt is not None and opt.muon is None
            and (opt.torch_kwargs is not None or amsgrad)):
        raise ConfigError("config key 'zero_optimization.offload_optimizer.gradients_on_device' = true needs the "
                          "optimizer Adam/AdamW on the fused host kernel, which reads the gradient chunk by chunk; "
                          f"got optimizer.type {opt.type!r}{' with amsgrad' if amsgrad else ''}")


# DeepSpeed optimizer types with no counterpart here, and what to use instead.
REFUSED_OPTIMIZERS = {
    "onebitadam": "1-bit Adam's compressed communication is not built; use 'Adam' (the same update before "
                  "its freeze_step)",
    "onebitlamb": "1-bit LAMB's compressed communication is not built; use 'Lamb'",
    "zerooneadam": "0/1 Adam is not built; use 'Adam'",
    "lion": "Lion is not built; use 'AdamW' or pass a client optimizer",
    "muadam": "MuP's MuAdam is not built; use 'Adam' with per-group learning rates",
    "muadamw": "MuP's MuAdamW is not built; use 'AdamW' with per-group learning rates",
    "musgd": "MuP's MuSGD is not built; use 'SGD' with per-group learning rates",
}


def _torch_optimizer(name: str):
    cls = getattr(torch.optim, name, None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
        return cls
    return None


@dataclass
class OptimizerConfig:
    torch_kwargs: ClassVar[dict | None] = None     # set per instance: the params of a torch.optim type
    muon: ClassVar[MuonParams | None] = None       # set per instance: type Muon's params
    type: str = option("Adam", "Adam or AdamW (our fused kernel; AdamW forces adam_w_mode = true), Lamb "
                               "(DeepSpeed's FusedLamb, stages 0-2), Muon (DeepSpeed's: Muon for the matrices, "
                               "AdamW for the rest; docs/muon.md), or any torch.optim class name (SGD, "
                               "Adagrad, RMSprop, ...), which then runs on this rank's partition, as DeepSpeed "
                               "runs getattr(torch.optim, type).")
    params: Any = option(factory=dict, help="The optimizer's hyper-parameters, as DeepSpeed names them.")

    def __post_init__(self):
        self._resolve("optimizer")

    def group_hyperparameters(self, group: dict, use_muon: bool | None = None) -> dict:
        """Type Muon: the ``use_muon`` half of ``group`` (`MuonParams.half`). Otherwise one param group's
        hyperparameters as the partition optimizers take them: ``lr``, ``betas``, ``eps`` and
        ``weight_decay`` from ``group`` where it sets them (a ``model_parameters`` group, as torch's), else from
        these params; ``adamw_mode`` (type AdamW, or ``adam_w_mode``) and ``bias_correction`` from these params."""
        if self.muon is not None:
            return self.muon.half(bool(use_muon), group)
        p = self.params
        return dict(lr=group.get("lr", p.lr), betas=tuple(group.get("betas", p.betas)), eps=group.get("eps", p.eps),
                    weight_decay=group.get("weight_decay", p.weight_decay),
                    adamw_mode=self.type == "AdamW" or p.adam_w_mode, bias_correction=p.bias_correction)

    def _resolve(self, path):
        if isinstance(self.params, AdamParams):
            return                        # already resolved (a copy of a resolved config)
        if not isinstance(self.params, dict):
            raise ConfigError(f"config key '{path}.params': got {self.params!r}, expected an object")
        raw = self.params
        if "max_grad_norm" in raw:
            raise ConfigError(f"config key '{path}.params.max_grad_norm' is not an optimizer parameter (DeepSpeed "
                              f"refuses it too); use the top-level 'gradient_clipping'")
        lower = self.type.lower()
        if lower in ("adam", "adamw"):
            self.type = "AdamW" if lower == "adamw" else "Adam"
            self.torch_kwargs = None
            self.params = from_dict(AdamParams, raw, f"{path}.params")
            if self.type == "AdamW" and not self.params.adam_w_mode:
                raise ConfigError(f"config key '{path}.params.adam_w_mode': false contradicts "
                                  f"'{path}.type' = 'AdamW'; use type 'Adam' for L2 weight decay")
            return
        if lower == "lamb":
            self.type = "Lamb"
            lamb = from_dict(LambParams, raw, f"{path}.params")
            self.torch_kwargs = {k: getattr(lamb, k) for k in raw}
            self.params = AdamParams(lr=lamb.lr, betas=lamb.betas, eps=lamb.eps, weight_decay=lamb.weight_decay,
                                     adam_w_mode=False, bias_correction=lamb.bias_correction)
            return
        if lower == "muon":
            self.type, self.torch_kwargs = "Muon", None
            self.muon = from_dict(MuonParams, raw, f"{path}.params")
            adam = self.muon.half(False, {})
            self.params = AdamParams(lr=self.muon.lr if self.muon.lr is not None else self.muon.half(True, {})["lr"],
                                     betas=adam["betas"], eps=adam["eps"], weight_decay=adam["weight_decay"],
                                     adam_w_mode=self.muon.adam_w_mode)
            return
        if lower in REFUSED_OPTIMIZERS:
            raise ConfigError(f"config key '{path}.type': {self.type!r} is accepted by DeepSpeed but not "
                              f"implemented in zero-offload ({REFUSED_OPTIMIZERS[lower]})")
        cls = _torch_optimizer(self.type)
        if cls is None:
            raise ConfigError(f"config key '{path}.type': got {self.type!r}, allowed: 'Adam', 'AdamW', 'Lamb' or "
                              f"a torch.optim class name (SGD, Adagrad, RMSprop, ...)")
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        for key in raw:
            if key not in accepted:
                raise ConfigError(f"unknown config key '{path}.params.{key}' for torch.optim.{cls.__name__}; "
                                  f"valid keys: {', '.join(sorted(accepted))}")
        self.torch_kwargs = dict(raw)
        lr = raw.get("lr", inspect.signature(cls.__init__).parameters["lr"].default
                      if "lr" in accepted else 1e-3)
        self.params = AdamParams(lr=float(lr), weight_decay=float(raw.get("weight_decay", 0.0)))


@dataclass
class WarmupLRParams:
    warmup_min_lr: float = option(0.0, "Learning rate at the first step.", min=0.0)
    warmup_max_lr: float | None = option(None, "Learning rate reached after warmup (default: the optimizer's "
                                               "lr, as DeepSpeed 0.19.8).", min=0.0)
    warmup_num_steps: int = option(1000, "Steps of warmup. DeepSpeed warms up over max(2, n) steps; 0 (which "
                                         "DeepSpeed 0.19.8 refuses and older versions clamped) is read as 2, "
                                         "with a warning.", min=0)
    warmup_type: Literal["log", "linear"] = option("log", "Shape of the warmup curve.")

    def validate(self, path):
        if self.warmup_num_steps == 0:
            warnings.warn(f"config key '{path}.warmup_num_steps' = 0: DeepSpeed warms up over max(2, n) steps, "
                          f"so the rate reaches warmup_max_lr at the second step (DeepSpeed 0.19.8 refuses 0; "
                          f"earlier versions clamp it the same way)", stacklevel=4)


@dataclass
class WarmupDecayLRParams(WarmupLRParams):
    warmup_max_lr: float = option(0.001, "Learning rate reached after warmup.", min=0.0)
    total_num_steps: int = option(None, "Steps until the rate has decayed linearly to 0 (required).", min=1)

    def validate(self, path):
        super().validate(path)
        if self.total_num_steps is None:
            raise ConfigError(f"config key '{path}.total_num_steps' is required for WarmupDecayLR")


@dataclass
class OneCycleParams:
    cycle_min_lr: float = option(None, "Lower bound of the cycle's learning rate (required).", min=0.0)
    cycle_max_lr: float = option(None, "Upper bound of the cycle's learning rate (required).", min=0.0)
    decay_lr_rate: float = option(0.0, "After the cycle: lr = cycle_min_lr / (1 + rate x intervals).", min=0.0)
    cycle_first_step_size: int = option(2000, "Steps of the rising half of the cycle.", min=1)
    cycle_second_step_size: int | None = option(None, "Steps of the falling half (default: the first's).",
                                                min=0)
    cycle_first_stair_count: int = option(0, "Stairs in the rising half (0: continuous).", min=0)
    cycle_second_stair_count: int | None = option(None, "Stairs in the falling half (default: the first's).",
                                                  min=0)
    decay_step_size: int = option(0, "Steps per decay interval after the cycle (0: no decay).", min=0)
    cycle_momentum: bool = option(True, "Cycle Adam's beta1 inversely to the lr (sets beta2 to 0.99, as "
                                        "DeepSpeed does).")
    cycle_min_mom: float = option(0.8, "Lower bound of beta1.", min=0.0)
    cycle_max_mom: float = option(0.9, "Upper bound of beta1.", min=0.0)
    decay_mom_rate: float = option(0.0, "After the cycle: beta1 = cycle_max_mom x (1 + rate x intervals).",
                                   min=0.0)

    def validate(self, path):
        for key in ("cycle_min_lr", "cycle_max_lr"):
            if getattr(self, key) is None:
                raise ConfigError(f"config key '{path}.{key}' is required for OneCycle")


@dataclass
class LRRangeTestParams:
    lr_range_test_min_lr: float = option(1e-3, "Learning rate at the first step.", min=0.0)
    lr_range_test_step_size: int = option(2000, "Steps per increase interval.", min=1)
    lr_range_test_step_rate: float = option(1.0, "lr = min_lr x (1 + rate x intervals).")
    lr_range_test_staircase: bool = option(False, "Whole intervals only (a staircase) instead of continuous.")


@dataclass
class WarmupCosineLRParams:
    total_num_steps: int = option(None, "Steps of the whole schedule (required).", min=1)
    warmup_min_ratio: float = option(0.0, "Start of warmup as a fraction of the optimizer's lr.", min=0.0)
    warmup_num_steps: int = option(1000, "Steps of warmup (DeepSpeed uses max(2, n)).", min=1)
    cos_min_ratio: float = option(0.0001, "End of the cosine decay as a fraction of the optimizer's lr.",
                                  min=0.0)
    warmup_type: Literal["log", "linear"] = option("log", "Shape of the warmup curve.")

    def validate(self, path):
        if self.total_num_steps is None:
            raise ConfigError(f"config key '{path}.total_num_steps' is required for WarmupCosineLR")


SCHEDULER_PARAMS = {"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
                    "WarmupCosineLR": WarmupCosineLRParams, "OneCycle": OneCycleParams,
                    "LRRangeTest": LRRangeTestParams}


@dataclass
class SchedulerConfig:
    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"] = option(
        None, "The learning-rate schedule, stepped with every optimizer step (DeepSpeed's names).")
    params: Any = option(factory=dict, help="The schedule's parameters, as DeepSpeed names them.")

    def validate(self, path):
        if self.type is None:
            raise ConfigError(f"config key '{path}.type' is required; allowed: {', '.join(SCHEDULER_PARAMS)}")
        if not isinstance(self.params, dict):
            raise ConfigError(f"config key '{path}.params': got {self.params!r}, expected an object")
        self.params = from_dict(SCHEDULER_PARAMS[self.type], self.params, f"{path}.params")
