"""Hugging Face ``"auto"`` config values, resolved as ``transformers.integrations.deepspeed`` does wherever the
engine knows the value (`resolve_auto`, from an `AutoContext`); elsewhere the error names the key and the argument
that supplies it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zero_offload.config.schema import ConfigError

__all__ = ["AutoContext", "resolve_auto"]


@dataclass
class AutoContext:
    """What the engine knows when it resolves ``"auto"`` values.

    Attributes:
        world_size: data-parallel ranks.
        model: the model (its ``config.hidden_size`` sizes buckets, as transformers does), or None.
        device: the compute device (fp16/bf16 ``"auto"`` follow it).
        values: dotted key -> value supplied by the caller (a client optimizer's lr, TrainingArguments, ...);
            these win over everything else.
    """
    world_size: int = 1
    model: Any = None
    device: torch.device | None = None
    values: dict = field(default_factory=dict)


# Where a value the engine cannot know comes from, as transformers fills it (TrainingArguments field).
_SUPPLIED_BY = {
    "gradient_clipping": "TrainingArguments.max_grad_norm",
    "optimizer.params.lr": "TrainingArguments.learning_rate (or a client optimizer)",
    "optimizer.params.betas": "TrainingArguments.adam_beta1/adam_beta2 (or a client optimizer)",
    "optimizer.params.eps": "TrainingArguments.adam_epsilon (or a client optimizer)",
    "optimizer.params.weight_decay": "TrainingArguments.weight_decay (or a client optimizer)",
    "scheduler.params.total_num_steps": "the number of training steps (transformers: num_training_steps)",
    "scheduler.params.warmup_num_steps": "TrainingArguments.warmup_steps",
    "train_micro_batch_size_per_gpu": "TrainingArguments.per_device_train_batch_size",
    "train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps x world size",
}


def _hidden_size(model) -> int | None:
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if isinstance(getattr(c, "hidden_size", None), int):
            return c.hidden_size
        sizes = getattr(c, "hidden_sizes", None)
        if sizes:
            return max(sizes)
    return None


def _get(data: dict, dotted: str):
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(data: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[last] = value


def _auto_keys(data, path="") -> list[str]:
    out = []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _auto_keys(v, f"{path}.{k}" if path else k)
    elif data == "auto":
        out.append(path)
    return out


def resolve_auto(data: dict, ctx: AutoContext | None) -> dict:
    """Replace every ``"auto"`` value in ``data`` (in place) as transformers' DeepSpeed integration would.

    Known here: batch keys from the other batch keys (an ``"auto"`` batch key is left to DeepSpeed's batch
    arithmetic), bucket and persistence sizes from ``model.config.hidden_size`` (reduce_bucket_size = h^2,
    stage3_prefetch_bucket_size = 0.9 h^2, stage3_param_persistence_threshold = 10 h), fp16/bf16 from the
    device (bf16 on an accelerator that has it, else fp16 on CUDA, else fp32), ``warmup_min_lr`` = 0,
    ``warmup_max_lr`` = the optimizer's lr, ``gradient_accumulation_steps`` from the batch keys.

    Raises:
        ConfigError: an ``"auto"`` the engine cannot know; the message names the key and the argument
            that supplies it.
    """
    keys = _auto_keys(data)
    if not keys:
        return data
    ctx = ctx or AutoContext()
    for key in keys:
        if key in ctx.values:
            _set(data, key, ctx.values[key])
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for key in batch_keys:
        if data.get(key) == "auto":
            data.pop(key)
    if not any(k in data for k in ("train_batch_size", "train_micro_batch_size_per_gpu")) and \
            any(k in keys for k in batch_keys[:2]):
        key = next(k for k in batch_keys[:2] if k in keys)
        raise ConfigError(f"config key '{key}' = 'auto' cannot be resolved: no other batch key fixes it; set "
                          f"it to a number (transformers fills it from {_SUPPLIED_BY[key]})")
    zero = data.get("zero_optimization") if isinstance(data.get("zero_optimization"), dict) else {}
    sized = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
             "stage3_param_persistence_threshold": lambda h: 10 * h}
    for key, rule in sized.items():
        if zero.get(key) == "auto":
            h = _hidden_size(ctx.model)
            if h is None:
                raise ConfigError(f"config key 'zero_optimization.{key}' = 'auto' needs the model's hidden size "
                                  f"(model.config.hidden_size, as transformers reads it); the model has none: "
                                  f"set the key to a number")
            zero[key] = rule(h)
    precision = [k for k in ("fp16", "bf16") if isinstance(data.get(k), dict) and data[k].get("enabled") == "auto"]
    if precision:
        dev = ctx.device or torch.device("cpu")
        bf16_ok = dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        choice = "bf16" if bf16_ok and "bf16" in precision else (
            "fp16" if dev.type == "cuda" and "fp16" in precision else None)
        for k in precision:
            data[k]["enabled"] = k == choice
    sched = _get(data, "scheduler.params")
    if isinstance(sched, dict):
        if sched.get("warmup_min_lr") == "auto":
            sched["warmup_min_lr"] = 0.0            # transformers: fill_only(..., 0)
        if sched.get("warmup_max_lr") == "auto":
            lr = _get(data, "optimizer.params.lr")
            if isinstance(lr, (int, float)) and not isinstance(lr, bool):
                sched["warmup_max_lr"] = lr
    left = [k for k in _auto_keys(data)]
    if left:
        key = left[0]
        if key == "scheduler.params.warmup_max_lr":
            source = "optimizer.params.lr (or TrainingArguments.learning_rate)"
        else:
            source = _SUPPLIED_BY.get(key, "no argument: set it to a value")
        raise ConfigError(f"config key '{key}' = 'auto' cannot be resolved by zero-offload; give it a value "
                          f"(transformers fills it from {source})")
    return data
