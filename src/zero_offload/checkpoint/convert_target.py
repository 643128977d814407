"""What `convert` loads a checkpoint into and saves it from: a `CheckpointTarget` that holds no partitions.

A conversion is a load and a save through the same readers and writers `engine.load_checkpoint` and
`engine.save_checkpoint` use. Every reader ends in ``load_state_chunks(g, step, chunks)`` with ``chunks`` a lazy
stream of partition pieces (read from the source one parameter or one slice at a time), and every writer starts
from ``state_chunks(g)``. `StreamedPartitions` keeps the stream at the load and hands it on at the save, so the
pieces go from the source's files to the destination's without the partition ever being whole: peak memory is
about one parameter's fp32 state (master weights and two moments), as DeepSpeed's ``ds_to_universal.py`` holds a
whole rank's.

`ConversionTarget` is the rest of an engine as the checkpoint code sees it: a skeleton model (parameters on the
meta device, real buffers), the config, the param groups' hyperparameters, and the engine's small state
(counters, loss scaler, LR schedule), kept as a dict in `Engine.state_dict`'s form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from zero_offload.config import AutoContext, Config
from zero_offload.optim.lr_schedules import build_scheduler
from zero_offload.precision import LossScaler
from zero_offload.runtime.state import ENGINE_STATE_KEYS, StateChunk, check_engine_state, checked_chunks
from zero_offload.zero.layout import GroupLayout, place_slots

__all__ = ["StreamedPartitions", "ConversionTarget", "single_rank_layout"]


@dataclass(frozen=True)
class _Slot:
    name: str
    shape: tuple
    numel: int
    offset: int
    end: int


def single_rank_layout(names: list[str], shapes: dict[str, tuple]) -> GroupLayout:
    """One param group on one rank: the parameters ``names`` end to end, in that order, without padding."""
    slots, offset = [], 0
    for name in names:
        numel = int(torch.Size(shapes[name]).numel())
        slots.append(_Slot(name, tuple(shapes[name]), numel, offset, offset + numel))
        offset += numel
    return GroupLayout(offset, tuple(place_slots(slots, max(offset, 1))))


class StreamedPartitions:
    """`PartitionedOptimizerState` of one rank that stores nothing: ``load_state_chunks`` keeps each group's
    stream of pieces and ``state_chunks`` passes it on, checked, once. Stage 2's place in a manifest: one
    partition per group (`single_rank_layout`), Adam's states."""

    stage = 2

    def __init__(self, layout: list[GroupLayout]):
        self._layout = layout
        self._steps = [0] * len(layout)
        self._streams: list[Iterator[StateChunk] | None] = [None] * len(layout)

    @property
    def partitions_count(self) -> int:
        return 1

    def layout(self) -> list[GroupLayout]:
        return list(self._layout)

    def group_step(self, g: int) -> int:
        return self._steps[g]

    def load_state_chunks(self, g: int, step: int, chunks: Iterable[StateChunk]) -> None:
        """Keep ``chunks`` (not read yet) as group ``g``'s state, with step count ``step``."""
        self._steps[g] = int(step)
        self._streams[g] = iter(chunks)

    def state_chunks(self, g: int, chunk_numel: int = 0) -> Iterator[StateChunk]:
        """The pieces `load_state_chunks` was given for group ``g``, checked to cover its partition in order.

        Raises:
            RuntimeError: group ``g`` was never loaded, or its stream was passed on already (it is read once).
            ValueError: pieces that do not cover the partition (`checked_chunks`).
        """
        stream, self._streams[g] = self._streams[g], None
        if stream is None:
            raise RuntimeError(f"group {g}'s state is a stream read once: it was not loaded, or already passed on")
        return checked_chunks(stream, g, self._layout[g].partition_numel)

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}                       # frozen parameters are buffers of the skeleton, whole

    def frozen_state(self, every_rank: bool = True) -> dict[str, torch.Tensor]:
        return {}

    def load_frozen_state(self, values: dict[str, torch.Tensor]) -> None:
        if values:
            raise ValueError(f"frozen parameters {sorted(values)} have no shards here: they are module buffers")

    def state_format(self) -> str:
        return "adam"

    def after_load(self) -> None:
        """Nothing to bring up to date: there are no 16-bit parameters."""


class _Hyperparameters:
    """The ``optimizer.param_groups`` face the writers read: one dict of hyperparameters per group."""

    def __init__(self, param_groups: list[dict]):
        self.param_groups = param_groups


class ConversionTarget:
    """A `CheckpointTarget` for `convert`: rank 0 of 1 on the CPU, ``module`` (the skeleton), ``config`` (a
    `Config`), groups of (hyperparameters, parameter names) in the module's parameter order, and
    `StreamedPartitions` over `single_rank_layout`. Its ``state_dict()`` starts as a fresh engine's under
    ``config`` (step 0, the loss scaler's and LR schedule's initial state, each group's lr) and holds what a load
    gives it.

    Raises:
        ConfigError: an invalid ``config`` (as `Config.load`).
    """

    rank, world_size, device = 0, 1, torch.device("cpu")

    def __init__(self, module: torch.nn.Module, config: dict, groups: list[tuple[dict, list[str]]]):
        self.module = module
        self.config = Config.load(config, auto=AutoContext(1, None, self.device))
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        self.optimizer = _Hyperparameters([self.config.optimizer.group_hyperparameters(h) for h, _ in groups])
        self.optimizer_state = StreamedPartitions([single_rank_layout(names, shapes) for _, names in groups])
        self._scaler = LossScaler(self.config)
        schedule = build_scheduler(self.config.scheduler, self.optimizer)
        self._state = {"global_step": 0, "skipped_steps": 0, "micro_steps": 0,
                       "loss_scaler": self._scaler.state_dict(),
                       "lr_scheduler": schedule.state_dict() if schedule is not None else None,
                       "lrs": [g["lr"] for g in self.optimizer.param_groups]}

    @property
    def global_step(self) -> int:
        return int(self._state["global_step"])

    def state_dict(self) -> dict:
        """`Engine.state_dict`'s keys and form."""
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Take `Engine.state_dict`'s form (the learning rates set each group's lr).

        Raises:
            ValueError: a missing key, a learning rate list of another length or an invalid loss scaler state.
        """
        check_engine_state(state, len(self.optimizer.param_groups))
        self._scaler.validate_state_dict(state["loss_scaler"])
        self._state = {k: state[k] for k in ENGINE_STATE_KEYS}
        for group, lr in zip(self.optimizer.param_groups, state["lrs"]):
            group["lr"] = float(lr)
