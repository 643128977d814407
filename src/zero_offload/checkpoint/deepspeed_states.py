"""What every DeepSpeed checkpoint holds besides the optimizer's partitions: the model states file
(``mp_rank_00_model_states.pt``, or stage 3's ``zero_pp_rank_0_mp_rank_00_model_states.pt``) with the parameter
names and shapes per group (``param_shapes``), buffers, frozen parameters, the LR schedule, the counters and the
user's ``client_state`` keys; and the refusal of what cannot be mapped (tensor or pipeline parallelism, MoE experts,
optimizer state left in NVMe swap files, checkpoints written without ZeRO). `ModelStates` is the base of both
readers (`deepspeed_zero.ZeroShards`, `deepspeed_universal.UniversalFiles`).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from zero_offload.checkpoint.foreign_pickle import Foreign, load_pt
from zero_offload.checkpoint.io import CheckpointError
from zero_offload.runtime.state import CheckpointTarget

__all__ = ["ModelStates", "MODEL_STATES", "as_int", "numel"]

MODEL_STATES = "mp_rank_00_model_states.pt"
# The keys DeepSpeed writes into the model states file itself; the rest is the user's client_state.
_OWN_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
             "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
             "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
             "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info", "ds_autoep_layers"}


def as_int(value: Any) -> int:
    """An int from DeepSpeed's ints, 0-d tensors and enums (`Foreign` records of ``ZeroStageEnum``)."""
    if isinstance(value, Foreign):
        value = value.args[0]
    return int(value.item() if torch.is_tensor(value) else value)


def numel(shape) -> int:
    return math.prod(int(d) for d in shape)


class ModelStates:
    """What both layouts share: the model states file, the refusals, and the engine's small state."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._refuse_unmappable()
        model_files = sorted(directory.glob("*model_states.pt"))
        if not model_files:
            raise CheckpointError(f"DeepSpeed checkpoint '{directory}' has no model states file "
                                  f"('{MODEL_STATES}' or 'zero_pp_rank_0_mp_rank_00_model_states.pt')")
        first = directory / MODEL_STATES if (directory / MODEL_STATES).is_file() else model_files[0]
        self.model_file = first
        self.model = load_pt(first)
        if not isinstance(self.model, dict) or "param_shapes" not in self.model:
            raise CheckpointError(f"checkpoint file '{first}' is not a DeepSpeed model states file (no "
                                  f"'param_shapes')")
        dims = self.model.get("checkpoint_parallel_dimensions") or {}
        if int(self.model.get("mp_world_size", 1)) > 1 or int(dims.get("tp_degree", 1)) > 1:
            raise CheckpointError(f"checkpoint file '{first}' was written with tensor parallelism (degree "
                                  f"{max(int(self.model.get('mp_world_size', 1)), int(dims.get('tp_degree', 1)))}), "
                                  f"which this engine does not map; convert it with DeepSpeed's ds_to_universal "
                                  f"on a tensor-parallel model first")
        if int(dims.get("pp_degree", 1)) > 1:
            raise CheckpointError(f"checkpoint file '{first}' was written with pipeline parallelism, which this "
                                  f"engine does not map")
        if "num_experts" in self.model or self.model.get("ds_autoep_layers"):
            raise CheckpointError(f"checkpoint file '{first}' holds MoE expert-parallel layers, which this engine "
                                  f"does not map")
        shapes = self.model["param_shapes"]
        if not shapes:
            raise CheckpointError(f"checkpoint file '{first}' was written without ZeRO (stage 0: no partitions, "
                                  f"no 'param_shapes'), which this reader does not map; resume it in DeepSpeed at "
                                  f"ZeRO stage 1-3 and save again")
        groups = shapes if isinstance(shapes, list) else [shapes]
        self.groups = [{name: tuple(int(d) for d in shape) for name, shape in g.items()} for g in groups]
        self.shapes = {name: shape for g in self.groups for name, shape in g.items()}

    def _refuse_unmappable(self) -> None:
        d = self.directory
        for pattern, why in (("layer_*", "pipeline-parallel layer files"), ("*expert_*", "MoE expert files"),
                             ("mp_rank_01_*", "tensor-parallel rank files"),
                             ("*_mp_rank_01_*", "tensor-parallel rank files")):
            found = sorted(d.glob(pattern))
            if found:
                raise CheckpointError(f"DeepSpeed checkpoint '{d}' holds {why} ('{found[0].name}'), which this "
                                      f"engine does not map")
        if (d / "offloaded_tensors").is_dir():
            raise CheckpointError(f"DeepSpeed checkpoint '{d}' keeps its optimizer state in NVMe swap files "
                                  f"('{d / 'offloaded_tensors'}'); resume it in DeepSpeed and save it without NVMe "
                                  f"offload, or convert it with ds_to_universal")

    def module_state(self) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters (full tensors), by name."""
        module = self.model.get("module") or {}
        names = set(self.model.get("buffer_names") or ()) | set(self.model.get("frozen_param_shapes") or {})
        return {n: t for n, t in module.items() if n in names and torch.is_tensor(t) and t.numel() > 0}

    def named_groups(self) -> list[tuple[dict, list[str]]]:
        """(hyperparameters, parameter names) per param group. At stage 3 ``param_shapes`` lists sub-groups: they
        map onto the param groups one to one when there are as many (DeepSpeed cuts a group into several only
        beyond ``sub_group_size``), and all into one group when the groups' hyperparameters are the same.

        Raises:
            CheckpointError: neither holds, so which parameters each group holds is unknown.
        """
        hparams = self.param_groups()
        names = [list(g) for g in self.groups]
        if len(hparams) == len(names):
            return list(zip(hparams, names))
        if all(h == hparams[0] for h in hparams):
            return [(hparams[0], [n for g in names for n in g])]
        raise CheckpointError(f"checkpoint file '{self.model_file}' lists {len(names)} parameter sub-groups for "
                              f"{len(hparams)} param groups with different hyperparameters: which parameters each "
                              f"group holds is not recorded")

    def engine_state(self, engine: CheckpointTarget, lrs: list[float], loss_scaler: Any,
                     lr_scheduler: bool) -> dict:
        """Overrides of ``engine.state_dict()``: counters, learning rates, loss scaler, LR schedule (DeepSpeed's
        schedules keep ``last_batch_iteration``, as ours do)."""
        mine = engine.state_dict()
        out = {"global_step": int(self.model.get("global_steps", 0)),
               "skipped_steps": int(self.model.get("skipped_steps", 0))}
        if len(lrs) == len(mine["lrs"]):
            out["lrs"] = [float(lr) for lr in lrs]
        scaler = _loss_scaler(loss_scaler, mine["loss_scaler"])
        if scaler is not None:
            out["loss_scaler"] = scaler
        saved = self.model.get("lr_scheduler")
        if lr_scheduler and mine["lr_scheduler"] is not None and isinstance(saved, dict):
            if "last_batch_iteration" not in saved:
                raise CheckpointError(f"checkpoint file '{self.model_file}' holds an LR schedule of another kind "
                                      f"(keys {sorted(saved)}) than this engine's DeepSpeed-style schedule")
            out["lr_scheduler"] = {**mine["lr_scheduler"],
                                   "last_batch_iteration": int(saved["last_batch_iteration"])}
        return out

    def client_state(self) -> dict:
        return {k: v for k, v in self.model.items() if k not in _OWN_KEYS}


def _loss_scaler(saved: Any, mine: dict) -> dict | None:
    """Our loss scaler state from DeepSpeed's ``DynamicLossScaler`` (None for a static one: fp32 and bf16)."""
    if not isinstance(saved, Foreign) or not saved.state.get("dynamic"):
        return None
    s = saved.state
    return {**mine, "scale": float(s["cur_scale"]), "hysteresis": int(s.get("cur_hysteresis", mine["hysteresis"])),
            "iteration": int(s.get("cur_iter", 0)), "last_overflow_iteration": int(s.get("last_overflow_iter", -1))}
