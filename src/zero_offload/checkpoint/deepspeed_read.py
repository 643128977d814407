"""Resume from a DeepSpeed checkpoint : a ZeRO checkpoint as DeepSpeed 0.19 writes it at stage
1, 2 or 3, or a universal checkpoint (``ds_to_universal.py``'s output), into any ZeRO stage and world size here.

A ZeRO checkpoint (``save_dir/tag/``):
  ``mp_rank_00_model_states.pt``            stages 1-2: the module's state dict (16-bit), ``param_shapes`` (one
                                            ordered {name: shape} per param group), the LR schedule, counters
                                            and the user's ``client_state`` keys;
  ``zero_pp_rank_R_mp_rank_00_model_states.pt``  stage 3: the same per rank, parameters empty, frozen
                                            parameters as per-rank fragments;
  ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``  rank R's partition: fp32 master weights
                                            (``single_partition_of_fp32_groups`` at stages 1-2,
                                            ``fp32_flat_groups`` per sub-group at stage 3), Adam's moments of the
                                            same flat partitions, the step, the loss scaler, the param groups.
Stages 1-2 lay each param group out flat (parameters in ``param_shapes`` order, each followed by its alignment
padding) and cut it into equal partitions; stage 3 cuts every parameter into ``ceil(numel / ranks)`` pieces, and
rank R's flat partition is its piece of every parameter in order (``deepspeed/utils/zero_to_fp32.py``). A
universal checkpoint holds each parameter whole: ``tag/zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt`` and
``step.pt``, with ``tag/zero/optimizer_state.pt`` for the loss scaler and param groups.

`load_deepspeed` reads, on each rank, only the parameters its partitions hold pieces of, one at a time; the rank
files are memory-mapped, so nothing beyond one parameter's state is held. Everything is checked on every rank
before the engine changes: the layout against each rank file (sizes, DeepSpeed's own slice mappings), the
parameters against the model (the first one missing or shaped otherwise is named), the optimizer (Adam's
moments), and what cannot be mapped (tensor or pipeline parallelism, MoE experts, NVMe-offloaded optimizer
state) is refused naming the file and the reason. The files are read with `foreign_pickle.load_pt`: DeepSpeed
need not be installed, and no code in the files runs.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from zero_offload.checkpoint.deepspeed_universal import UniversalFiles
from zero_offload.checkpoint.deepspeed_zero import ZeroShards
from zero_offload.checkpoint.foreign import ForeignState, apply_foreign, check_parameters, module_values
from zero_offload.checkpoint.io import CheckpointError, agree
from zero_offload.checkpoint.manifest import check_tag
from zero_offload.runtime.state import CheckpointTarget

__all__ = ["find_deepspeed", "load_deepspeed", "read_deepspeed"]


def find_deepspeed(load_dir: str | os.PathLike, tag: str | None = None) -> Path | None:
    """The tag directory of the DeepSpeed checkpoint at ``load_dir`` (``tag``, else the one ``latest`` or
    ``latest_universal`` names; ``load_dir`` itself when it is a tag directory), or None when there is none."""
    root = Path(load_dir)
    if tag is None and _is_tag_dir(root):
        return root
    if tag is None:
        for pointer in ("latest", "latest_universal"):
            if (root / pointer).is_file():
                tag = check_tag((root / pointer).read_text().strip(), f"'{root / pointer}'")
                break
    return root / tag if tag is not None and _is_tag_dir(root / tag) else None


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("*model_states.pt")) or (path / "zero" / "optimizer_state.pt").is_file())


def read_deepspeed(directory: Path) -> ZeroShards | UniversalFiles:
    """The reader of the DeepSpeed checkpoint in tag directory ``directory`` (its layout recognised)."""
    if (directory / "zero" / "optimizer_state.pt").is_file():
        return UniversalFiles(directory)
    return ZeroShards(directory)


def load_deepspeed(engine: CheckpointTarget, directory: str | os.PathLike, load_optimizer_states: bool = True,
                   load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> Any:
    """Load the DeepSpeed checkpoint in tag directory ``directory`` into ``engine`` (see the module docstring);
    returns its ``client_state`` (the keys the user passed to DeepSpeed's ``save_checkpoint``). A collective.

    The flags mirror DeepSpeed's ``load_checkpoint``: without ``load_optimizer_states`` the moments start at zero
    and the step at 0; without ``load_lr_scheduler_states`` the engine keeps its schedule; ``load_module_only``
    loads the weights alone (as master weights) and leaves counters, schedule and loss scale as they are.

    Raises:
        CheckpointError: a missing, truncated or damaged file (named), a checkpoint of another model (the first
            parameter that differs named), an optimizer other than Adam, or what cannot be mapped (tensor or
            pipeline parallelism, MoE, NVMe-offloaded state). Nothing in the engine is changed then.
    """
    directory = Path(directory)
    error, reader, state = None, None, None
    try:
        reader = read_deepspeed(directory)
        if engine.optimizer_state.state_format() != reader.state_format():
            raise CheckpointError(f"checkpoint '{directory}': a DeepSpeed checkpoint of {reader.state_format()!r} "
                                  f"states cannot be loaded into an engine whose optimizer keeps "
                                  f"{engine.optimizer_state.state_format()!r}")
        check_parameters(engine, reader.shapes, f"'{reader.model_file}'")
        mine = [p.name for g in engine.optimizer_state.layout() for p in g.params]
        if isinstance(reader, UniversalFiles):
            reader.check(mine)
        full = load_optimizer_states and not load_module_only
        state = ForeignState(step=reader.step() if full else 0,
                             module=module_values(engine, reader.module_state(), f"'{reader.model_file}'"),
                             client_state=reader.client_state())
        if not load_module_only:
            lrs = [g["lr"] for g in reader.param_groups()] if full else []
            state.engine = reader.engine_state(engine, lrs, reader.loss_scaler(),
                                               load_lr_scheduler_states)
    except CheckpointError as e:
        error = e
    agree(engine, error, "loading the DeepSpeed checkpoint")
    read = reader.read if load_optimizer_states and not load_module_only else _weights_only(reader.read)
    return apply_foreign(engine, read, state)


def _weights_only(read):
    def weights(name: str, shape: tuple) -> dict:
        master = read(name, shape)["master"]
        return {"master": master, "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
    return weights
