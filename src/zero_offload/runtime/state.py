"""The state protocols between the engine's parts and the checkpoint code.

In the spirit of ``torch.distributed.checkpoint.stateful.Stateful``: every part that holds training state
(the engine's counters, the loss scaler, the LR schedule, the partitioned optimizer) gives it out with
``state_dict()`` and takes it back with ``load_state_dict()``; nothing outside a part reads its private
fields. The partitioned optimizer also reads and writes its tensors in pieces, one group at a time, so that a
checkpoint can stream them (states swapped to NVMe never need to be whole in memory).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Protocol, runtime_checkable

import torch

__all__ = ["Stateful", "PartitionedOptimizerState", "CheckpointTarget", "STATE_KINDS", "ENGINE_STATE_KEYS",
           "StateChunk", "check_engine_state", "checked_chunks", "fill_from_chunks", "WholeGroupState"]

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
# The keys of an engine's ``state_dict()`` (`CheckpointTarget`): its counters, loss scaler, LR schedule and lrs.
ENGINE_STATE_KEYS = ("global_step", "skipped_steps", "micro_steps", "loss_scaler", "lr_scheduler", "lrs")
StateChunk = tuple[int, dict[str, torch.Tensor]]   # (offset in the group's partition, {kind: fp32 CPU tensor})


@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint's Stateful: state out as a dict, and back in."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class PartitionedOptimizerState(Protocol):
    """This rank's partition of the optimizer state, one partition per param group (stage 0: the whole).

    Implemented by `ZeroOptimizer` and `Stage3Optimizer`. ``layout()`` says where every parameter's
    elements sit in the ranks' partitions (`zero_offload.zero.layout.GroupLayout`); ``partitions_count``
    is how many distinct partitions exist (1 at stage 0).
    """

    stage: int

    @property
    def partitions_count(self) -> int: ...

    def layout(self) -> list: ...

    def group_step(self, g: int) -> int:
        """Optimizer steps taken by group ``g``."""

    def state_chunks(self, g: int, chunk_numel: int = ...) -> Iterator[StateChunk]:
        """Yield group ``g``'s partition as (offset, {kind: fp32 CPU tensor}) pieces, kinds `STATE_KINDS`, in
        increasing offset. A piece may be a view of a reused buffer: use (or copy) it before asking for the
        next one (NVMe states stream through a small pool)."""

    def load_state_chunks(self, g: int, step: int, chunks: Iterable[StateChunk]) -> None:
        """Replace group ``g``'s partition from pieces covering it, with step count ``step``."""

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: full shape} of the frozen (``requires_grad=False``) parameters held sharded (stage 3), under
        every name `zero_offload.checkpoint.io.module_state` lists them; {} where frozen parameters are whole in the
        module."""

    def frozen_state(self, every_rank: bool = True) -> dict[str, torch.Tensor]:
        """{name: full CPU tensor} for `frozen_shapes`' names: a collective (every rank calls it); with
        ``every_rank=False`` only rank 0 gets the tensors, the others {}."""

    def load_frozen_state(self, values: dict[str, torch.Tensor]) -> None:
        """Write the named frozen parameters' full values (as `frozen_state` gave them) into this rank's
        shards; not a collective."""

    def state_format(self) -> str:
        """What the ``exp_avg``/``exp_avg_sq`` kinds hold: ``adam`` (Adam's moments) or ``torch.<type>:<state
        names>`` for a torch optimizer on the partitions; a checkpoint loads only into the same format."""

    def after_load(self) -> None:
        """Bring the 16-bit parameters every rank uses up to date after partitions were replaced (a
        collective at stage >= 1)."""


def check_engine_state(state: dict, group_count: int) -> None:
    """``state`` must have every key of `ENGINE_STATE_KEYS` and one learning rate per param group.

    Raises:
        ValueError: naming the missing keys, or the number of learning rates and of groups.
    """
    missing = [k for k in ENGINE_STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"engine state lacks {', '.join(missing)}")
    if len(state["lrs"]) != group_count:
        raise ValueError(f"engine state has {len(state['lrs'])} learning rates for {group_count} param groups")


def checked_chunks(chunks: Iterable[StateChunk], g: int, numel: int) -> Iterator[StateChunk]:
    """The pieces of ``chunks`` in order, each checked before it is yielded: it must start where the last one
    ended and stay inside group ``g``'s partition of ``numel`` elements (the length of a piece is its
    ``master``'s).

    Raises:
        ValueError: a piece that does not continue the partition or runs past it (before that piece is
            yielded), or pieces that stop short of its end (after the last one was yielded), naming group
            ``g``, offsets and sizes.
    """
    covered = 0
    for lo, piece in chunks:
        length = piece["master"].numel()
        if lo != covered or lo + length > numel:
            raise ValueError(f"optimizer state piece at offset {lo} ({length} elements) does not continue "
                             f"group {g}'s partition of {numel} elements at {covered}")
        yield lo, piece
        covered = lo + length
    if covered != numel:
        raise ValueError(f"optimizer state pieces cover {covered} of group {g}'s {numel} elements")


def fill_from_chunks(chunks: Iterable[StateChunk], g: int, targets: dict[str, torch.Tensor]) -> None:
    """Copy (offset, {kind: 1-D tensor}) pieces into ``targets`` ({kind: partition-sized tensor}, ``master``
    among them), in order; kinds of a piece not in ``targets`` are dropped.

    Raises:
        ValueError: as `checked_chunks` (nothing is written from a piece that fails the check; a gap at the
            end is reported after the pieces were written).
    """
    for lo, piece in checked_chunks(chunks, g, targets["master"].numel()):
        length = piece["master"].numel()
        for kind, t in targets.items():
            t[lo:lo + length].copy_(piece[kind])


class WholeGroupState:
    """Whole-partition state built on the chunked face, for a partition optimizer (`PartitionedAdam`,
    `NvmeAdam`) that holds ``parts`` (per group, its 1-D partition) and defines ``group_step(g)``,
    ``state_chunks(g)`` and ``load_state_chunks(g, step, chunks)``. Whole tensors are fp32 CPU of shape
    (partition numel,), kinds `STATE_KINDS`."""

    parts: list[torch.Tensor]

    @property
    def group_count(self) -> int:
        """Param groups, one partition each."""
        return len(self.parts)

    def group_numel(self, g: int) -> int:
        """Elements in group ``g``'s partition on this rank."""
        return self.parts[g].numel()

    def group_state(self, g: int) -> dict:
        """Group ``g``'s partition state whole: ``step`` and fresh fp32 CPU copies of every kind."""
        whole = {k: torch.empty(self.group_numel(g)) for k in STATE_KINDS}
        for lo, piece in self.state_chunks(g):
            for k, v in piece.items():
                whole[k][lo:lo + v.numel()] = v
        return {"step": self.group_step(g), **whole}

    def load_group_state(self, g: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         step: int) -> None:
        """Replace group ``g``'s state (tensors of the partition's shape) and write its parameters from
        ``master``."""
        self.load_state_chunks(g, step, [(0, {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})])

    def state_dict(self) -> dict:
        """{"groups": [`group_state`(g) for every group]}: this rank's partitions whole (fresh copies).
        `state_chunks` reads the same without a whole copy."""
        return {"groups": [self.group_state(g) for g in range(self.group_count)]}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (same partition sizes).

        Raises:
            ValueError: a different number of groups or a partition of another size (nothing is changed).
        """
        groups = state["groups"]
        if len(groups) != self.group_count:
            raise ValueError(f"optimizer state has {len(groups)} param groups, this optimizer {self.group_count}")
        for g, s in enumerate(groups):
            if s["master"].numel() != self.group_numel(g):
                raise ValueError(f"optimizer state of group {g} has {s['master'].numel()} elements, this "
                                 f"rank's partition {self.group_numel(g)}")
        for g, s in enumerate(groups):
            self.load_state_chunks(g, int(s["step"]), [(0, {k: s[k] for k in STATE_KINDS})])


class CheckpointTarget(Stateful, Protocol):
    """What `zero_offload.checkpoint` needs of an engine: its identity among the ranks, its model and config,
    its small state (``state_dict()``: counters, loss scaler, LR schedule; JSON-serialisable) and its
    partitioned optimizer state."""

    module: torch.nn.Module
    config: Any
    global_step: int

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def optimizer_state(self) -> PartitionedOptimizerState: ...
