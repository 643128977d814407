"""Write DeepSpeed's universal checkpoint layout, which DeepSpeed 0.19 resumes at any ZeRO stage
and world size with ``"checkpoint": {"load_universal": true}``:

  ``save_dir/latest_universal``, ``save_dir/latest``   the tag;
  ``tag/zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt``       each parameter's fp32 master weights and Adam moments,
                                                       whole (``{"param": tensor, "cat_dim": 0}``, as
                                                       ``ds_to_universal.py`` writes them), and ``step.pt``;
  ``tag/zero/optimizer_state.pt``                      the param groups (lr, betas, eps, weight decay), the step,
                                                       gradient clipping and, for fp16, the loss scaler as
                                                       DeepSpeed's ``DynamicLossScaler``;
  ``tag/mp_rank_00_model_states.pt``                   the module's buffers and frozen parameters (its
                                                       trainable parameters empty, as stage 3 writes them: the
                                                       universal files hold them), ``param_shapes``, the LR
                                                       schedule, the counters and the ``client_state`` keys
                                                       (stage 1-2's name; ``tag/zero_pp_rank_0_mp_rank_00_
                                                       model_states.pt``, stage 3's, the same).

The engine's own sharded checkpoint is staged first (every rank writes its partition), then rank 0 writes the
universal files one parameter at a time from it (`full_parameters`), into a temporary folder renamed to ``tag``
when complete; the ``latest`` files are replaced last. Peak memory on rank 0 is one parameter (plus the buffers and
frozen parameters).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from zero_offload.checkpoint.dcp import adamw_group
from zero_offload.checkpoint.foreign import export_staged
from zero_offload.checkpoint.foreign_pickle import foreign_class, save_pt
from zero_offload.checkpoint.io import staged_directory
from zero_offload.checkpoint.manifest import check_tag
from zero_offload.runtime.state import CheckpointTarget

__all__ = ["save_universal", "DEEPSPEED_VERSION"]

DEEPSPEED_VERSION = "0.19.8"           # the layout written is this release's
_KINDS = {"master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def save_universal(engine: CheckpointTarget, save_dir: str | os.PathLike, tag: str | None = None,
                   client_state: Any = None) -> Path:
    """Write the engine's training state under ``save_dir/tag`` in DeepSpeed's universal layout (see the module
    docstring); ``tag`` defaults to ``global_step{N}``. Returns the tag directory. A collective: every rank
    calls it.

    Raises:
        CheckpointError: writing failed on some rank (named); a checkpoint already at ``save_dir/tag`` is kept.
        ValueError: a ``client_state`` that is not a dict (DeepSpeed stores its keys beside its own).
    """
    if client_state is not None and not isinstance(client_state, dict):
        raise ValueError(f"save_checkpoint: format='deepspeed-universal' stores client_state's keys in the model "
                         f"states file, so it must be a dict; got {type(client_state).__name__}")
    root = Path(save_dir)
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_step}", "the tag argument")
    opt = engine.optimizer_state
    groups = [[(p.name, tuple(p.shape)) for p in g.params] for g in opt.layout()]
    step = opt.group_step(0) if groups else 0
    hparams = [dict(h) for h in engine.optimizer.param_groups]
    small = {"engine": engine.state_dict(), "world": engine.world_size,
             "clipping": float(engine.config.gradient_clipping or 0.0), "fp16": engine.config.fp16,
             "batch": engine.config.batch_sizes(engine.world_size).train_batch_size,
             "buffers": _persistent_buffers(engine.module),
             "frozen": {n: tuple(p.shape) for n, p in engine.module.named_parameters() if not p.requires_grad}}

    def write(directory: Path, manifest: dict) -> None:
        from zero_offload.checkpoint.load import full_parameters
        with staged_directory(root / tag, "universal") as staging:
            zero = staging / "zero"
            for kind, file in _KINDS.items():
                for name, t in full_parameters(directory, manifest, kind):
                    (zero / name).mkdir(parents=True, exist_ok=True)
                    torch.save({"param": t.clone(), "cat_dim": 0}, zero / name / f"{file}.pt")
            for name, _ in (p for g in groups for p in g):
                torch.save(torch.tensor(float(step)), zero / name / "step.pt")
            save_pt(_optimizer_state(hparams, step, small), zero / "optimizer_state.pt")
            states = _model_states(_module(directory, manifest), groups, small, client_state or {})
            for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
                save_pt(states, staging / name)
        for pointer in ("latest_universal", "latest"):
            (root / f".{pointer}.tmp").write_text(tag)
            os.replace(root / f".{pointer}.tmp", root / pointer)

    export_staged(engine, root / tag, write, "the DeepSpeed universal checkpoint")
    return root / tag


def _optimizer_state(hparams: list[dict], step: int, small: dict) -> dict:
    groups = [adamw_group(h, [g]) for g, h in enumerate(hparams)]      # DeepSpeed's groups are torch's
    out = {"dynamic_loss_scale": False, "overflow": False, "clip_grad": small["clipping"],
           "ds_version": DEEPSPEED_VERSION, "partition_count": small["world"], "param_groups": groups,
           "optimizer_state_dict": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": groups}}
    scaler = small["engine"]["loss_scaler"]
    fp16 = small["fp16"]
    if fp16.enabled and fp16.loss_scale == 0:
        record = foreign_class("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")()
        record.state = {"cur_scale": float(scaler["scale"]), "dynamic": True, "cur_iter": int(scaler["iteration"]),
                        "last_overflow_iter": int(scaler["last_overflow_iteration"]), "scale_factor": 2.0,
                        "scale_window": int(fp16.loss_scale_window), "min_scale": float(fp16.min_loss_scale),
                        "delayed_shift": int(fp16.hysteresis), "cur_hysteresis": int(scaler["hysteresis"]),
                        "consecutive_hysteresis": bool(fp16.consecutive_hysteresis),
                        "raise_error_at_min_scale": True, "dtype": torch.float16}
        out.update(loss_scaler=record, dynamic_loss_scale=True)
    return out


def _model_states(module: dict, groups: list, small: dict, client_state: dict) -> dict:
    engine = small["engine"]
    return {**client_state, "module": module, "buffer_names": small["buffers"], "optimizer": None,
            "param_shapes": [{name: torch.Size(shape) for name, shape in g} for g in groups],
            "frozen_param_shapes": {n: torch.Size(s) for n, s in small["frozen"].items()}, "shared_params": {},
            "frozen_param_fragments": {},
            "lr_scheduler": engine["lr_scheduler"], "data_sampler": None, "random_ltd": None,
            "skipped_steps": int(engine["skipped_steps"]), "global_steps": int(engine["global_step"]),
            "global_samples": int(engine["global_step"]) * int(small["batch"]), "dp_world_size": small["world"],
            "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_version": DEEPSPEED_VERSION, "universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}


def _persistent_buffers(module: torch.nn.Module) -> list[str]:
    """The buffers ``module.state_dict()`` holds (DeepSpeed's ``buffer_names``)."""
    names = set(module.state_dict())
    return [n for n, _ in module.named_buffers() if n in names]


def _module(directory: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The model states file's ``module``: every state_dict name, the buffers and frozen parameters with their
    values (our checkpoint's module state file), the trainable parameters as empty tensors."""
    from safetensors.torch import load_file
    from zero_offload.checkpoint.io import MODULE_STATE
    saved = load_file(str(directory / MODULE_STATE)) if MODULE_STATE in manifest["files"] else {}
    return {name: saved.get(name, torch.empty(0)) for name in manifest["state_dict_keys"]}
