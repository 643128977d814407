"""What loading another framework's checkpoint (FSDP2's DCP, DeepSpeed's ZeRO and universal) shares: a source
that reads one parameter's full fp32 state at a time, the stream of this rank's partition pieces built from it,
and the one place where the engine changes.

A foreign checkpoint is always read parameter by parameter: each rank reads only the parameters its partitions
hold pieces of, one at a time, so a load never holds more than one parameter's full state (master weights and two
moments) beyond the engine's own memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from zero_offload.checkpoint.io import CheckpointError, agree, module_state
from zero_offload.runtime.state import STATE_KINDS, CheckpointTarget, StateChunk

__all__ = ["ParamReader", "ForeignState", "partition_chunks", "check_parameters", "module_values", "apply_foreign",
           "export_staged"]

ParamReader = Callable[[str, tuple], dict]
"""``read(name, shape)``: {"master", "exp_avg", "exp_avg_sq"}: the parameter's full fp32 state, flat."""


@dataclass
class ForeignState:
    """Everything a foreign checkpoint restores besides the partitions.

    ``step``: the optimizer's step count (Adam's bias correction); ``engine``: overrides of the engine's
    ``state_dict()`` (global step, skipped steps, loss scaler, LR schedule, learning rates); ``module``: buffers
    and frozen parameters by name (full tensors; stage-3 frozen parameters are sharded by the engine);
    ``client_state``: what `load_checkpoint` returns.
    """
    step: int
    engine: dict = field(default_factory=dict)
    module: dict[str, torch.Tensor] = field(default_factory=dict)
    client_state: Any = None


def check_parameters(engine: CheckpointTarget, saved: dict[str, tuple], where: str) -> None:
    """Every trainable parameter of ``engine`` must be in ``saved`` ({name: shape}) with its shape.

    Raises:
        CheckpointError: naming ``where`` and the first parameter that is missing or shaped otherwise.
    """
    for group in engine.optimizer_state.layout():
        for p in group.params:
            if p.name not in saved:
                raise CheckpointError(f"checkpoint {where} is from another model: it has no parameter '{p.name}'")
            if tuple(saved[p.name]) != tuple(p.shape):
                raise CheckpointError(f"checkpoint {where} is from another model: parameter '{p.name}' has shape "
                                      f"{list(saved[p.name])} there and {list(p.shape)} here")


def partition_chunks(group, rank: int, read: ParamReader) -> Iterator[StateChunk]:
    """This rank's partition of ``group`` (a `GroupLayout`) as contiguous pieces (padding as zeros), reading
    each parameter it holds a piece of once, in partition order."""
    covered = 0
    for p in sorted((p for p in group.params if any(c.rank == rank for c in p.pieces)),
                    key=lambda p: min(c.part_offset for c in p.pieces if c.rank == rank)):
        full = read(p.name, tuple(p.shape))
        for c in sorted((c for c in p.pieces if c.rank == rank), key=lambda c: c.part_offset):
            if c.part_offset > covered:
                yield covered, {k: torch.zeros(c.part_offset - covered) for k in STATE_KINDS}
            yield c.part_offset, {k: full[k][c.param_offset:c.param_offset + c.length].float() for k in STATE_KINDS}
            covered = c.part_offset + c.length
    if covered < group.partition_numel:
        yield covered, {k: torch.zeros(group.partition_numel - covered) for k in STATE_KINDS}


def apply_foreign(engine: CheckpointTarget, read: ParamReader, state: ForeignState) -> Any:
    """Load the partitions (streamed from ``read``), the module's buffers and frozen parameters and the engine's
    small state into ``engine``; returns ``state.client_state``. Call it only after every check passed on every
    rank (`zero_offload.checkpoint.io.agree`): from here on the engine changes."""
    opt = engine.optimizer_state
    rank = engine.rank if opt.partitions_count > 1 else 0
    for g, group in enumerate(opt.layout()):
        opt.load_state_chunks(g, state.step, partition_chunks(group, rank, read))
    live = module_state(engine.module)
    sharded = opt.frozen_shapes()
    with torch.no_grad():
        for name, value in state.module.items():
            if name in live and name not in sharded:
                live[name].copy_(value)
    opt.load_frozen_state({k: v for k, v in state.module.items() if k in sharded})
    opt.after_load()
    engine.load_state_dict({**engine.state_dict(), **state.engine})
    return state.client_state


def module_values(engine: CheckpointTarget, saved: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The entries of ``saved`` that are this model's buffers or frozen parameters, checked for shape.

    Raises:
        CheckpointError: a buffer or frozen parameter of another shape (named, with ``where``).
    """
    live = {k: tuple(v.shape) for k, v in module_state(engine.module).items()}
    live.update(engine.optimizer_state.frozen_shapes())
    out = {}
    for name, value in saved.items():
        if name in live:
            if tuple(value.shape) != live[name]:
                raise CheckpointError(f"checkpoint {where} holds buffer or frozen parameter '{name}' "
                                      f"{tuple(value.shape)}; this model has {live[name]}")
            out[name] = value
    return out


def export_staged(engine: CheckpointTarget, path, write: Callable, what: str) -> None:
    """Write a foreign checkpoint at ``path`` from this engine's own: every rank saves its partition into a staging
    checkpoint beside ``path`` (`save_checkpoint`), rank 0 calls ``write(tag directory, manifest)`` to write the
    foreign files from it, and the staging checkpoint is removed. A collective.

    Raises:
        CheckpointError: ``write`` failed on rank 0 (every rank raises, naming it).
    """
    import shutil
    from pathlib import Path
    from zero_offload.checkpoint.load import read_manifest, resolve_tag
    from zero_offload.checkpoint.save import save_checkpoint
    path = Path(path)
    staging = path.parent / f".{path.name}.zero-offload"
    save_checkpoint(engine, staging, "state", None)
    error = None
    if engine.rank == 0:
        try:
            directory = resolve_tag(staging, "state")
            write(directory, read_manifest(directory))
        except (OSError, ValueError, RuntimeError, CheckpointError) as e:
            error = CheckpointError(f"writing {what} '{path}' failed: {e}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    agree(engine, error, f"writing {what}")
