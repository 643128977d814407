"""``deepspeed.initialize(mpu=...)``: a model-parallel unit is accepted only when it adds no parallelism.

DeepSpeed takes from ``mpu`` the model-, pipeline- and sequence-parallel sizes and the data-parallel group
(``bwc_tensor_model_parallel_world_size``, ``bwc_pipeline_parallel_world_size``, ``get_data_parallel_group``).
zero-offload is data parallel over the whole world only, so an ``mpu`` whose model/pipeline/sequence sizes
are 1 and whose data-parallel group is every rank changes nothing and is accepted; any other is refused.
"""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["check_mpu"]

# (what it is, the mpu methods DeepSpeed 0.19.8 asks for it, newest name first)
_SIZES = (("tensor/model parallel", ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size")),
          ("pipeline parallel", ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")),
          ("sequence parallel", ("get_sequence_parallel_world_size",)))


def check_mpu(mpu) -> None:
    """Accept ``mpu`` if it describes plain data parallelism over all ranks.

    Raises:
        ValueError: a model/pipeline/sequence-parallel size above 1, or a data-parallel group that is not
            every rank; the message names ``mpu``, the method and its value.
    """
    for what, methods in _SIZES:
        for name in methods:
            if callable(getattr(mpu, name, None)):
                size = int(getattr(mpu, name)())
                if size != 1:
                    raise ValueError(f"deepspeed.initialize(mpu=...): mpu.{name}() = {size}, but {what} is not "
                                     f"built in zero-offload (data parallel only); pass mpu=None or a size of 1")
                break
    world = dist.get_world_size() if dist.is_initialized() else 1
    ranks = list(range(world))
    if callable(getattr(mpu, "get_data_parallel_group", None)):
        group = mpu.get_data_parallel_group()
        got = dist.get_process_group_ranks(group) if dist.is_initialized() and group is not None else ranks
        if sorted(got) != ranks:
            raise ValueError(f"deepspeed.initialize(mpu=...): mpu.get_data_parallel_group() holds ranks {got}, "
                             f"but zero-offload runs data parallel over every rank {ranks}")
    if callable(getattr(mpu, "get_data_parallel_world_size", None)):
        size = int(mpu.get_data_parallel_world_size())
        if size != world:
            raise ValueError(f"deepspeed.initialize(mpu=...): mpu.get_data_parallel_world_size() = {size}, but "
                             f"zero-offload runs data parallel over all {world} ranks")
