"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums, as ``engine.offload_states`` takes them."""
from __future__ import annotations

from enum import Enum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, Enum):
    """Where an offload goes (DeepSpeed's values)."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """What ``engine.offload_states(include=[...])`` moves (DeepSpeed's values)."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
