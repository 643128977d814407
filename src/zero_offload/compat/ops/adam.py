"""``deepspeed.ops.adam``: `DeepSpeedCPUAdam` under DeepSpeed's name and signature."""
from __future__ import annotations

import torch

from zero_offload.optim.cpu_adam import CPUAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed 0.19.8's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)``: Adam (``adamw_mode=False``: L2 weight decay added to the gradient) or
    AdamW on the fused host kernel (`CPUAdam`).

    As in DeepSpeed, construction takes parameters anywhere (a script builds it over the model before
    ``deepspeed.initialize``, which then steps its own host partitions with these hyper-parameters and param
    groups); only `step` called directly needs fp32 CPU parameters. ``adam_w_mode`` is the attribute DeepSpeed
    sets; each param group also carries ``adamw_mode`` and ``bias_correction`` (CPUAdam's group keys).

    Raises:
        ValueError: a hyper-parameter out of range; ``amsgrad=True`` (DeepSpeed documents it as not supported
            and ignores it; pass ``torch.optim.AdamW(amsgrad=True)`` instead); ``fp32_optimizer_states=False``
            (moments are always fp32 here); `step` over a parameter that is not an fp32 CPU tensor.
    """

    checks_params_at_init = False

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdam(amsgrad=True) is not supported (DeepSpeed ignores it); use "
                             "torch.optim.AdamW(amsgrad=True) as the client optimizer")
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) as a client optimizer is not built: give "
                             "the config's optimizer.params.fp32_optimizer_states = false (or "
                             "bf16.bf16_optimizer_states) for bf16 host moments")
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = True
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw_mode=adamw_mode, bias_correction=bias_correction)

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """`CPUAdam.step` over fp32 CPU parameters.

        Raises:
            ValueError: a parameter with a gradient that is not an fp32 CPU tensor (DeepSpeed asserts the same:
                "CPUAdam param is on ... and must be 'cpu'").
        """
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and (p.device.type != "cpu" or p.dtype != torch.float32):
                    raise ValueError(f"DeepSpeedCPUAdam.step: parameters must be fp32 CPU tensors, got {p.dtype} on "
                                     f"{p.device}; pass the optimizer to deepspeed.initialize with "
                                     f"zero_optimization.offload_optimizer.device 'cpu' instead")
        return super().step(closure, **kwargs)


class FusedAdam(torch.optim.Adam):
    """DeepSpeed 0.19.8's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
    set_grad_none)``: Adam on the parameters' own device (torch's fused or foreach Adam), AdamW when
    ``adam_w_mode`` (the default) and Adam with L2 weight decay when not, as DeepSpeed's. Passed to
    ``deepspeed.initialize`` it becomes the config's Adam/AdamW section with its param groups (`compat.optimizer`).

    Raises:
        ValueError: ``bias_correction=False`` (torch's Adam always corrects; use the config's Adam with
            ``bias_correction: false``), or a hyper-parameter torch's Adam refuses.
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        if not bias_correction:
            raise ValueError("FusedAdam(bias_correction=False) is not built; give the config's optimizer "
                             "{'type': 'AdamW', 'params': {'bias_correction': false}} instead")
        self.adam_w_mode = adam_w_mode
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode)
        for group in self.param_groups:
            group.setdefault("bias_correction", True)
        self.defaults["bias_correction"] = True
