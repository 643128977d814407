"""``deepspeed.initialize(mpu=...)``: a model-parallel unit is accepted when it adds no parallelism, or only the
Ulysses sequence parallelism zero-offload builds.

DeepSpeed takes from ``mpu`` the model-, pipeline- and sequence-parallel sizes and the data-parallel group
(``bwc_tensor_model_parallel_world_size``, ``bwc_pipeline_parallel_world_size``, ``get_data_parallel_group``).
An ``mpu`` whose model/pipeline/sequence sizes are 1 and whose data-parallel group is every rank changes nothing
and is accepted. A sequence-parallel ``mpu`` (DeepSpeed's ``parallel_state_sp``, which aliases the model-parallel
questions to the sequence-parallel ones, or the groups ``register_with_transformers`` returns) is accepted when its
groups are the ones `zero_offload.sequence.groups` made; its size becomes ``sequence_parallel_size``. Any other is
refused.
"""
from __future__ import annotations

import torch.distributed as dist

from zero_offload.sequence import groups as sequence_groups

__all__ = ["check_mpu"]

# (what it is, the mpu methods DeepSpeed 0.19.8 asks for it, newest name first)
_SIZES = (("tensor/model parallel", ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size")),
          ("pipeline parallel", ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")),
          ("sequence parallel", ("get_sequence_parallel_world_size",)))


def _sequence_parallel_size(mpu) -> int:
    """The sequence-parallel size of an ``mpu`` that answers for the groups made here (1: it asks for none).

    Raises:
        ValueError: a size above 1 with groups that were not made by ``register_with_transformers`` /
            ``parallel_state_sp.initialize_sequence_parallel``.
    """
    ask = getattr(mpu, "get_sequence_parallel_world_size", None)
    size = int(ask()) if callable(ask) else 1
    made = sequence_groups.current()
    if size > 1 and (made is None or made.size != size or mpu.get_sequence_parallel_group() is not made.group):
        raise ValueError(f"deepspeed.initialize(mpu=...): mpu.get_sequence_parallel_world_size() = {size}, but its "
                         f"groups are not the Ulysses groups zero-offload made; make them with "
                         f"UlyssesSPAttentionHF.register_with_transformers or "
                         f"parallel_state_sp.initialize_sequence_parallel")
    return size


def check_mpu(mpu) -> int:
    """Accept ``mpu`` if it describes plain data parallelism over all ranks, or the Ulysses groups made here, and
    return its sequence-parallel size (1 for none).

    Raises:
        ValueError: a model/pipeline-parallel size above 1, sequence-parallel groups not made here, or a
            data-parallel group that is not every rank; the message names ``mpu``, the method and its value.
    """
    sp = _sequence_parallel_size(mpu)
    for what, methods in _SIZES[:2] if sp > 1 else _SIZES:
        if sp > 1 and what == "tensor/model parallel" and not callable(getattr(mpu, methods[0], None)):
            continue    # parallel_state_sp answers the model-parallel questions with the sequence-parallel size
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
    return sp
