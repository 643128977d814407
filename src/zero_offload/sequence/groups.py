"""The sequence-parallel process groups: which ranks share one sequence (Ulysses; ALST, arXiv 2506.13996).

Mirrors DeepSpeed 0.19.8's ``deepspeed.runtime.sequence_parallel.parallel_state_sp``: the world splits into
consecutive blocks of ``size`` ranks, each block one sequence-parallel group that holds one sequence between them
(rank r is sequence-parallel rank ``r % size`` of group ``r // size``). ZeRO still partitions over every rank (the
"sequence-data-parallel" group is the whole world), so nothing about partitioning, checkpoints or resharding
changes with the size; only the batch arithmetic (``world // size`` data-parallel replicas) and the gradient
average do (`zero_offload.sequence.averaging`).

A `SequenceParallelGroups` is also the ``mpu`` object DeepSpeed's API hands around: it answers the same
``get_sequence_parallel_*`` / ``get_sequence_data_parallel_*`` / ``get_model_parallel_*`` questions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["SequenceParallelGroups", "initialize", "current", "release", "SequenceParallelError"]


class SequenceParallelError(ValueError):
    """A sequence-parallel size that does not fit the world, or disagrees with the groups already made."""


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's sequence-parallel group (``group``; None at size 1) and its place in the world.

    Attributes:
        size: ranks per sequence (``sequence_parallel_size``).
        world_size: every rank (the ZeRO partition group).
        rank: this rank's global rank.
        group: the torch process group of the ``size`` ranks that share this rank's sequence (None at size 1).
        world: ``torch.distributed.group.WORLD`` when the groups were made (a later process group makes them stale).
    """
    size: int
    world_size: int
    rank: int
    group: object = None
    world: object = None

    # -- DeepSpeed's mpu questions (parallel_state_sp) --
    def get_sequence_parallel_group(self):
        return self.group

    def get_sequence_parallel_world_size(self) -> int:
        return self.size

    def get_sequence_parallel_rank(self) -> int:
        return self.rank % self.size

    def get_sequence_data_parallel_group(self):
        return None            # the whole world (the default group)

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.rank

    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model that see different sequences: ``world_size // size``."""
        return self.world_size // self.size

    @property
    def data_parallel_rank(self) -> int:
        return self.rank // self.size

    def gradient_divisor(self, stage: int) -> int:
        """What the gradients summed over every rank are divided by (DeepSpeed 0.19.8): the data-parallel size at
        ZeRO stages 0-2, the world size at stage 3."""
        return self.data_parallel_size if stage < 3 else self.world_size

    def group_ranks(self) -> list[int]:
        """The global ranks of this rank's sequence-parallel group, in sequence order."""
        first = self.rank - self.rank % self.size
        return list(range(first, first + self.size))


_current: SequenceParallelGroups | None = None


def _world() -> tuple[int, int]:
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def current() -> SequenceParallelGroups | None:
    """The groups made by `initialize` in this process's current process group, else None."""
    global _current
    if _current is not None and (not dist.is_initialized() or _current.world is not dist.group.WORLD):
        _current = None        # the process group they belonged to was destroyed
    return _current


def initialize(size: int, key: str = "sequence_parallel_size") -> SequenceParallelGroups:
    """Make (once per process group) the sequence-parallel groups of ``size`` ranks; a call with the size already
    made returns the same groups. Every rank must call it (``new_group`` is collective). Size 1 makes nothing.

    Raises:
        SequenceParallelError: ``size`` < 1, not a divisor of the world size, or another size was made already;
            the message names ``key``, the size and the world size.
    """
    global _current
    world_size, rank = _world()
    if size == 1:
        return SequenceParallelGroups(1, world_size, rank)     # nothing to make, and nothing made is disturbed
    made = current()
    if made is not None:
        if made.size != size:
            raise SequenceParallelError(f"{key} = {size}, but sequence-parallel groups of {made.size} ranks were "
                                        f"already made in this process group; use one size per process group")
        return made
    if not isinstance(size, int) or size < 1 or world_size % size:
        raise SequenceParallelError(f"{key} = {size!r} must be a positive divisor of the world size {world_size} "
                                    f"(ranks per sequence; the rest are data-parallel replicas)")
    group = None
    if size > 1:
        for first in range(0, world_size, size):      # new_group is collective: every rank makes every group
            made_group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                group = made_group
    _current = SequenceParallelGroups(size, world_size, rank, group, dist.group.WORLD if dist.is_initialized()
                                      else None)
    return _current


def release() -> None:
    """Forget the groups (DeepSpeed's ``_release_sequence_parallel_groups``); torch destroys them with the world."""
    global _current
    _current = None
