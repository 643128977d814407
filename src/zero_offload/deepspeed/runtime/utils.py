"""``deepspeed.runtime.utils``: DeepSpeed's small helpers that training code imports."""
from __future__ import annotations

import gc

import torch

from zero_offload.compat.unbuilt import INSTEAD, unbuilt

__all__ = ["see_memory_usage", "move_to_device", "clip_grad_norm_", "get_global_norm", "PartitionedTensor",
           "noop_decorator"]

PartitionedTensor = unbuilt("deepspeed.runtime.utils.PartitionedTensor", INSTEAD["pipeline"])


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log device and host memory on rank 0 where ``force`` (DeepSpeed's helper)."""
    if not force:
        return
    import psutil
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()
    from zero_offload.deepspeed.accelerator import get_accelerator
    from zero_offload.deepspeed.utils.logging import logger
    acc = get_accelerator()
    logger.info(message)
    logger.info(f"MA {acc.memory_allocated() / 2**30:.2f} GB Max_MA {acc.max_memory_allocated() / 2**30:.2f} GB "
                f"CA {acc.memory_reserved() / 2**30:.2f} GB Max_CA {acc.max_memory_reserved() / 2**30:.2f} GB")
    vm = psutil.virtual_memory()
    logger.info(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / 2**30:.2f} GB, percent = {vm.percent}%")


def move_to_device(item, device, criterion_func=lambda t: True):
    """``item`` (tensors in nested lists, tuples and dicts) with each tensor that ``criterion_func`` accepts moved
    to ``device`` (DeepSpeed's helper; accelerate calls it)."""
    if torch.is_tensor(item):
        return item.to(device) if criterion_func(item) else item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def get_global_norm(norm_list) -> float:
    """sqrt of the sum of squares of ``norm_list``."""
    return sum(float(n) ** 2 for n in norm_list) ** 0.5


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None):
    """torch's ``clip_grad_norm_`` over the local gradients (``mpu`` accepted: data parallel only)."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)


def noop_decorator(func):
    return func
