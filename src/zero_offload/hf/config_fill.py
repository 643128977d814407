"""A DeepSpeed config's ``"auto"`` values filled from ``transformers.TrainingArguments``, as transformers does.

Mirrors ``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig`` (transformers 5.x):
``trainer_config_process`` (batch sizes, accumulation, clipping, optimizer lr/betas/eps/weight decay,
warm-up min/max lr, fp16/bf16, ``save_on_each_node``) and ``trainer_config_finalize`` (scheduler total and
warm-up steps). A key set to ``"auto"`` takes the argument's value; a key set to anything else must equal
it, and every mismatch is reported at once, as transformers does. The hidden-size keys
(``reduce_bucket_size``, ``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``) are left to
the engine, which resolves them from ``model.config.hidden_size`` with transformers' formulas.

Then what accelerate adds under transformers (`fill_as_accelerate`, accelerate 1.x's ``DeepSpeedPlugin``): its
``"auto"`` keys from its ``ACCELERATE_DEEPSPEED_*`` environment, and the Trainer's mixed precision as a
``bf16``/``fp16`` section where the config has none (``DeepSpeedPlugin.set_mixed_precision``).

This module needs no transformers: it reads only the ``TrainingArguments`` attributes named below.
"""
from __future__ import annotations

import copy
import os
from typing import Any

from zero_offload.config import ConfigError
from zero_offload.config.io import read_config_file

__all__ = ["load_ds_config", "fill_from_training_args", "fill_as_accelerate"]


def load_ds_config(ds_config: "dict | str | os.PathLike") -> dict:
    """A deep copy of ``ds_config`` (a dict) or the parsed file at that path (JSON or hjson).

    Raises:
        ConfigError: ``ds_config`` is neither a dict nor a path, or the file cannot be read or parsed.
    """
    if isinstance(ds_config, dict):
        return copy.deepcopy(ds_config)
    if isinstance(ds_config, (str, os.PathLike)):
        return read_config_file(ds_config)
    raise ConfigError(f"ds_config must be a dict or a path to a DeepSpeed JSON file, got {type(ds_config).__name__}")


class _Filler:
    """``HfTrainerDeepSpeedConfig.fill_match`` / ``fill_only`` over a plain dict, collecting mismatches."""

    def __init__(self, config: dict):
        self.config = config
        self.mismatches: list[str] = []

    def node(self, dotted: str) -> tuple[dict | None, str]:
        *parents, key = dotted.split(".")
        node: Any = self.config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return (node if isinstance(node, dict) else None), key

    def fill(self, dotted: str, hf_val, hf_key: str, must_match: bool = True) -> None:
        node, key = self.node(dotted)
        if node is None:
            return
        if node.get(key) == "auto":
            node[key] = hf_val
            return
        if not must_match:
            return
        ds_val = node.get(key)
        if ds_val is not None and not _same(ds_val, hf_val):
            self.mismatches.append(f"- ds {dotted}={ds_val} vs hf {hf_key}={hf_val}")


def _same(ds_val, hf_val) -> bool:
    if isinstance(ds_val, (list, tuple)) and isinstance(hf_val, (list, tuple)):
        return len(ds_val) == len(hf_val) and all(_same(a, b) for a, b in zip(ds_val, hf_val))
    return ds_val == hf_val


def fill_from_training_args(config: dict, args, num_training_steps: int, world_size: int | None = None) -> dict:
    """``config`` (a dict; changed in place and returned) with its ``"auto"`` values from ``args``.

    Args:
        config: the DeepSpeed config as a dict.
        args: a ``transformers.TrainingArguments`` (read: ``world_size``, ``per_device_train_batch_size``,
            ``gradient_accumulation_steps``, ``max_grad_norm``, ``learning_rate``, ``adam_beta1``/``adam_beta2``,
            ``adam_epsilon``, ``weight_decay``, ``fp16``/``fp16_full_eval``, ``bf16``/``bf16_full_eval``,
            ``save_on_each_node``, ``auto_find_batch_size``, ``get_warmup_steps``).
        num_training_steps: the run's optimizer steps (transformers' ``max_steps``): the scheduler's
            ``total_num_steps`` and, through ``args.get_warmup_steps``, ``warmup_num_steps`` (at least 1).
        world_size: data-parallel ranks; default ``args.world_size``.

    Raises:
        ConfigError: a key that is not ``"auto"`` and differs from its ``TrainingArguments`` value; the
            message lists every such key with both values (transformers raises the same list as ValueError).
    """
    world = args.world_size if world_size is None else world_size
    f = _Filler(config)
    match_batch = not getattr(args, "auto_find_batch_size", False)
    # trainer_config_process
    f.fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size",
           match_batch)
    f.fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    f.fill("train_batch_size", world * args.per_device_train_batch_size * args.gradient_accumulation_steps,
           "train_batch_size (calculated)", match_batch)
    f.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    f.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    f.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0, "", must_match=False)
    f.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if getattr(args, "save_on_each_node", False):
        config["checkpoint"] = config.get("checkpoint", {})
        config["checkpoint"]["use_node_local_storage"] = True
    f.fill("fp16.enabled", bool(args.fp16 or getattr(args, "fp16_full_eval", False)), "fp16|fp16_full_eval")
    f.fill("bf16.enabled", bool(args.bf16 or getattr(args, "bf16_full_eval", False)), "bf16|bf16_full_eval")
    # trainer_config_finalize (the hidden-size keys: the engine resolves them with the same formulas)
    f.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    f.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
    if f.mismatches:
        lines = "\n".join(f.mismatches)
        raise ConfigError("Please correct the following DeepSpeed config values that mismatch TrainingArguments "
                          f"values:\n{lines}\nThe easiest method is to set these DeepSpeed config values to 'auto'.")
    return config


# accelerate's DeepSpeedPlugin: config key -> (its environment variable, its default), filled where "auto".
_ACCELERATE_ENV = {
    "zero_optimization.stage": ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"),
    "zero_optimization.offload_optimizer.device": ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
    "zero_optimization.offload_param.device": ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none"),
    "zero_optimization.offload_optimizer.nvme_path": ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", "none"),
    "zero_optimization.offload_param.nvme_path": ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "none"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": ("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
                                                                    "false"),
}


def _env_value(dotted: str, raw: str):
    if dotted.endswith(".stage"):
        return int(raw)
    if dotted.endswith("on_model_save"):
        return raw.strip().lower() == "true"
    return raw


def mixed_precision_of(args) -> str:
    """The Trainer's mixed precision as accelerate names it: ``"fp16"``, ``"bf16"`` or ``"no"`` (transformers'
    ``Trainer.create_accelerator_and_postprocess`` passes ``fp16``/``bf16`` of the arguments)."""
    if getattr(args, "fp16", False):
        return "fp16"
    return "bf16" if getattr(args, "bf16", False) else "no"


def fill_as_accelerate(config: dict, args) -> dict:
    """``config`` (changed in place and returned) as accelerate hands it to DeepSpeed under the Trainer.

    Mirrors accelerate 1.x's ``DeepSpeedPlugin.__post_init__`` (each ``"auto"`` among the keys of
    ``_ACCELERATE_ENV`` from its environment variable, e.g. ``stage3_gather_16bit_weights_on_model_save`` from
    ``ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL``, default false) and ``set_mixed_precision``: with the
    Trainer's ``bf16`` (``fp16``) and no ``bf16`` (``fp16``) section, the section ``{"enabled": true}``
    (``{"enabled": true, "auto_cast": true}``) is added, so the model trains in the precision its arguments ask
    for; a missing section of the other type is added disabled.

    Raises:
        ConfigError: the Trainer asks for one 16-bit type and the config enables the other (accelerate's
            ValueError), naming both.
    """
    f = _Filler(config)
    for dotted, (env, default) in _ACCELERATE_ENV.items():
        node, key = f.node(dotted)
        if node is not None and node.get(key) == "auto":
            node[key] = _env_value(dotted, os.environ.get(env, default))
    mixed = mixed_precision_of(args)
    if mixed == "fp16" and "fp16" not in config:
        config["fp16"] = {"enabled": True, "auto_cast": True}
    elif mixed == "bf16" and "bf16" not in config:
        config["bf16"] = {"enabled": True}
    if mixed != "no":
        other = "bf16" if mixed == "fp16" else "fp16"
        section = config.get(other)
        if isinstance(section, dict) and str(section.get("enabled", "False")).lower() == "true":
            raise ConfigError(f"TrainingArguments.{mixed}=True but the DeepSpeed config sets {other}.enabled = true: "
                              f"enable one 16-bit type (accelerate refuses this pair too)")
    for dtype in ("fp16", "bf16"):
        config.setdefault(dtype, {"enabled": False})
    for dtype in ("fp16", "bf16"):
        if isinstance(config[dtype], dict) and config[dtype].get("enabled") == "auto":
            config[dtype]["enabled"] = mixed == dtype
    return config
