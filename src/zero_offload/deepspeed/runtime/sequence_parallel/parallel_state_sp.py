"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: DeepSpeed 0.19.8's sequence-parallel groups module (the
``mpu`` ``register_with_transformers`` returns there), answered by `zero_offload.sequence.groups`."""
from __future__ import annotations

from zero_offload.sequence import groups as _groups

__all__ = ["initialize_sequence_parallel", "get_sequence_parallel_group", "get_sequence_data_parallel_group",
           "get_sequence_parallel_world_size", "get_sequence_data_parallel_world_size", "get_sequence_parallel_rank",
           "get_sequence_data_parallel_rank", "get_model_parallel_rank", "get_model_parallel_world_size",
           "get_model_parallel_group"]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make the groups (`zero_offload.sequence.groups.initialize`; DeepSpeed asserts a size above 1).

    Raises:
        ValueError: a size of 1 or less; `SequenceParallelError` for one that does not divide the world.
    """
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    _groups.initialize(sequence_parallel_size)


def _made() -> _groups.SequenceParallelGroups:
    made = _groups.current()
    if made is None:
        raise AssertionError("sequence parallel group is not initialized")     # DeepSpeed asserts the same
    return made


def get_sequence_parallel_group():
    return _made().group


def get_sequence_data_parallel_group():
    return _made().get_sequence_data_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return _made().size


def get_sequence_data_parallel_world_size() -> int:
    return _made().world_size


def get_sequence_parallel_rank() -> int:
    return _made().get_sequence_parallel_rank()


def get_sequence_data_parallel_rank() -> int:
    return _made().rank


get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
