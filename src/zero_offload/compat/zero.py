"""``deepspeed.zero``: ``Init``, ``GatheredParameters`` and ``register_external_parameter`` over stage 3."""
from __future__ import annotations

import contextlib

import torch

from zero_offload.zero.stage3.gather import gathered_parameters, register_external_parameter
from zero_offload.zero.stage3.sharded_init import ShardedInit, shard_in_place

__all__ = ["Init", "GatheredParameters", "register_external_parameter"]


def Init(module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,  # noqa: N802
         pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
         zero_param_parallel_group=None, zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
         sequence_data_parallel_group=None, param_swapper=None):
    """DeepSpeed's ``zero.Init``: build the model inside it and ranks keep only their shards
    (`zero_offload.init_sharded`, its `ShardedInit`). ``enabled=False`` builds normally. With ``module``, that
    already-built model
    is partitioned in place at once (rank 0's values, each rank keeping its slice; a collective), as
    DeepSpeed's ``zero.Init(module=model)`` does; the returned context can still be entered."""
    if not enabled:
        return contextlib.nullcontext()
    if module is not None:
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"zero.Init(module=...) needs an nn.Module, got {type(module).__name__}")
        shard_in_place(module)
    return ShardedInit(on_built=_name_kernels_device)


def _name_kernels_device(module: torch.nn.Module) -> None:
    """A transformers model built here has meta parameters (DeepSpeed's are empty tensors on the device), and
    transformers' ``from_pretrained`` then kernelizes for the parameters' device: name the compute device, as
    transformers itself does for parameters offloaded to meta (``_kernels_device``)."""
    if hasattr(type(module), "set_use_kernels"):
        module._kernels_device = "cuda" if torch.cuda.is_available() else "cpu"


def GatheredParameters(params, modifier_rank: int | None = None,  # noqa: N802
                       fwd_module: torch.nn.Module | None = None, enabled: bool = True):
    """DeepSpeed's ``zero.GatheredParameters``: gather stage-3 parameters inside the block; with
    ``modifier_rank`` that rank's writes are kept on every rank (shards and fp32 masters). ``fwd_module`` is
    accepted and unused (DeepSpeed uses it to register the gathered parameters as external)."""
    return gathered_parameters(params, modifier_rank=modifier_rank, enabled=enabled)
