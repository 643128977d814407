"""``deepspeed.ops.adagrad``: `DeepSpeedCPUAdagrad` under DeepSpeed's name and signature."""
from __future__ import annotations

import torch

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed 0.19.8's ``DeepSpeedCPUAdagrad(model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False,
    fp32_optimizer_states=True)``: Adagrad with L2 weight decay, as torch's with ``lr_decay=0`` (accelerate builds
    it from a torch Adagrad when the optimizer is offloaded). Passed to ``deepspeed.initialize`` it runs as torch's
    Adagrad on this rank's partition.

    Raises:
        ValueError: ``amsgrad=True`` or ``fp32_optimizer_states=False`` (neither is an Adagrad option here).
    """

    def __init__(self, model_params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):
        if amsgrad or not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdagrad: amsgrad=True and fp32_optimizer_states=False are not built")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
