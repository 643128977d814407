"""The DeepSpeed 0.19.8 config keys accepted here without effect, and those refused, each with why.

Read from the tables the config code itself uses (`compat.IGNORED_*`, `compat.UNBUILT` and
``REMOVED_*``, `optim.REFUSED_OPTIMIZERS`) plus the settings checked by value, so that docs/configs.md's lists
(tests/test_readme_config_keys.py compares them) cannot drift from what the code does.
"""
from __future__ import annotations

from zero_offload.config.compat import (IGNORED_ACTIVATION_CHECKPOINTING, IGNORED_CHECKPOINT, IGNORED_COMPILE, IGNORED_OFFLOAD_OPTIMIZER, IGNORED_OFFLOAD_PARAM,
                                        IGNORED_TOP_LEVEL, IGNORED_ZERO, REMOVED_IN_DEEPSPEED,
                                        REMOVED_ZERO_IN_DEEPSPEED, UNBUILT)
from zero_offload.config.optim import REFUSED_OPTIMIZERS

__all__ = ["accepted_without_effect", "refused", "markdown_table"]

# Accepted, with a warning, only for some values (checked by value in config.py / config_compat.py / config_optim).
_BY_VALUE = {
    "allgather_size": "DeepSpeed reads it only with the legacy 'zero_optimization': true form",
    "bfloat16 (with bf16 also given)": "DeepSpeed reads only 'bf16'",
    "bf16.immediate_grad_update": "gradients always go straight to their partition",
    "bf16.bf16_optimizer_states (offload_optimizer.device 'none')": "the device Adam keeps fp32 moments",
    "gradient_predivide_factor (with prescale_gradients true)": "DeepSpeed ignores it then too",
    "optimizer.params.torch_adam": "the host step always uses zero-offload's kernel",
    "zero_optimization.contiguous_gradients = false": "gradients are always copied into contiguous buckets",
    "zero_optimization.offload_param (stage < 3)": "parameters are only partitioned (and offloaded) at stage 3; "
                                                   "DeepSpeed ignores it too (DeepSpeed-Chat sets it at every stage)",
    "zero_optimization.offload_optimizer.single_submit, overlap_events": "libaio submission modes; no effect "
                                                                          "with I/O threads",
    "scheduler WarmupLR warmup_num_steps = 0": "takes effect as DeepSpeed's clamp to 2 steps, with a warning",
}
_REFUSED_BY_VALUE = {
    "optimizer.params.max_grad_norm": "not an optimizer parameter (DeepSpeed refuses it too); use the "
                                     "top-level gradient_clipping",
    "zero_optimization.offload_optimizer.aio.use_gds = true": "GPUDirect Storage needs CUDA and cuFile",
    "optimizer.type Muon with ratio < 1, delayed_param_update, super_offload, bf16_master_weights_and_grads, "
    "gradients_on_device, or bf16_optimizer_states on NVMe":
        "not built for Muon yet; each refusal names the key and why (docs/muon.md)",
    "zero_optimization.offload_optimizer.gradients_on_device with delayed_param_update, super_offload, ratio < 1, "
    "device nvme, parameters on NVMe or an optimizer other than Adam/AdamW":
        "not built: the synchronous host step of the fused kernel only; each refusal names the keys",
}


def accepted_without_effect() -> list[tuple[str, str]]:
    """(key, why it changes nothing here) for every key accepted with one warning."""
    rows = list(IGNORED_TOP_LEVEL.items())
    rows += [(f"zero_optimization.{k}", v) for k, v in IGNORED_ZERO.items()]
    rows += [(f"zero_optimization.offload_optimizer.{k}", v) for k, v in IGNORED_OFFLOAD_OPTIMIZER.items()]
    rows += [(f"zero_optimization.offload_param.{k}", v) for k, v in IGNORED_OFFLOAD_PARAM.items()]
    rows += [(f"compile.{k}", v) for k, v in IGNORED_COMPILE.items()]
    rows += [(f"checkpoint.{k}", v) for k, v in IGNORED_CHECKPOINT.items()]
    rows += [(f"activation_checkpointing.{k}", v) for k, v in IGNORED_ACTIVATION_CHECKPOINTING.items()]
    return rows + list(_BY_VALUE.items())


def refused() -> list[tuple[str, str]]:
    """(key or setting, why) for every refused setting: not built here, or refused by DeepSpeed 0.19.8."""
    rows = list(UNBUILT.items())
    rows += [(f"optimizer.type {k}", v) for k, v in REFUSED_OPTIMIZERS.items()]
    rows += [(k, f"refused as DeepSpeed 0.19.8 refuses it: {v}") for k, v in REMOVED_IN_DEEPSPEED.items()]
    rows += [(f"zero_optimization.{k}", f"refused as DeepSpeed 0.19.8 refuses it: {v}")
             for k, v in REMOVED_ZERO_IN_DEEPSPEED.items()]
    return rows + list(_REFUSED_BY_VALUE.items())


def markdown_table(rows: list[tuple[str, str]]) -> str:
    lines = ["| key | why |", "|---|---|"]
    lines += [f"| `{k}` | {v.replace('|', '/')} |" for k, v in rows]
    return "\n".join(lines)


if __name__ == "__main__":      # python -m zero_offload.config.keys: the tables of docs/configs.md
    print(markdown_table(accepted_without_effect()))
    print()
    print(markdown_table(refused()))
