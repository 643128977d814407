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

__all__ = ["Stateful", "PartitionedOptimizerState", "CheckpointTarget", "STATE_KINDS", "StateChunk"]

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
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
