"""``deepspeed.utils.groups``: DeepSpeed's parallel-group queries. ZeRO partitions over every rank, so the
data-parallel group is the world, and model and expert parallelism have size 1 (their groups None), as DeepSpeed
answers without an ``mpu``. The sequence-parallel ones answer from the Ulysses groups once made
(`zero_offload.sequence.groups`; size 1 and None before), as DeepSpeed's do from the ``mpu`` it was given.
accelerate and transformers read them; the names keep DeepSpeed's leading underscores because callers use them so."""
from __future__ import annotations

import torch.distributed as dist

from zero_offload.sequence import groups as sequence_groups

__all__ = ["initialize", "get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank",
           "get_model_parallel_group", "get_model_parallel_world_size", "get_model_parallel_rank",
           "get_tensor_model_parallel_group", "get_tensor_model_parallel_world_size",
           "get_tensor_model_parallel_rank"]


def initialize(ep_size: int = 1, mpu=None) -> None:
    """DeepSpeed's expert-group setup: only ``ep_size=1`` and no ``mpu`` (data parallel only).

    Raises:
        ValueError: expert or model parallelism asked for.
    """
    if ep_size != 1 or mpu is not None:
        raise ValueError("deepspeed.utils.groups.initialize: expert and model parallelism are not built in "
                         "zero-offload (data parallel only); use ep_size=1 and mpu=None")


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_data_parallel_group():
    return dist.group.WORLD if dist.is_initialized() else None


def get_data_parallel_world_size() -> int:
    return _world()


def get_data_parallel_rank() -> int:
    return _rank()


def get_model_parallel_group():
    return None


def get_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0


get_tensor_model_parallel_group = get_model_parallel_group
get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_model_parallel_world_size = get_model_parallel_world_size


def _get_sequence_parallel_group():
    made = sequence_groups.current()
    return made.group if made is not None else None


def _get_sequence_parallel_world_size() -> int:
    made = sequence_groups.current()
    return made.size if made is not None else 1


def _get_sequence_parallel_rank() -> int:
    made = sequence_groups.current()
    return made.get_sequence_parallel_rank() if made is not None else 0


_get_sequence_data_parallel_group = get_data_parallel_group
_get_sequence_data_parallel_world_size = get_data_parallel_world_size
_get_sequence_data_parallel_rank = get_data_parallel_rank


def _get_data_parallel_group_ranks() -> list[int]:
    return list(range(_world()))


def _get_broadcast_src_rank() -> int:
    return 0


def _get_expert_model_parallel_world_size() -> int:
    return 1


def _get_max_expert_size() -> int:
    return 1
