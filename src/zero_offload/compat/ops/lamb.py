"""``deepspeed.ops.lamb``: `FusedLamb` under DeepSpeed's name and signature."""
from __future__ import annotations

from zero_offload.optim.lamb import Lamb

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    """DeepSpeed 0.19.8's ``FusedLamb(params, lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay,
    max_grad_norm, max_coeff, min_coeff, amsgrad)`` (`zero_offload.optim.lamb.Lamb`, on any device). Passed to
    ``deepspeed.initialize`` it becomes ``optimizer.type: "Lamb"`` with its hyper-parameters and param groups.

    Raises:
        ValueError: as `Lamb`; ``max_grad_norm`` > 0 (FusedLamb's own clipping: use the config's
            ``gradient_clipping``, as DeepSpeed's config path requires too).
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False):
        if max_grad_norm > 0:
            raise ValueError(f"FusedLamb(max_grad_norm={max_grad_norm}): clip with the config's "
                             f"'gradient_clipping' instead")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                         min_coeff=min_coeff, amsgrad=amsgrad)
