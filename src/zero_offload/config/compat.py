"""DeepSpeed's legacy and alternative config spellings, Hugging Face ``"auto"`` values, and unbuilt settings.

Applied to the raw dict before the typed `Config` is built, so the dataclasses see one spelling per key:

- legacy forms DeepSpeed 0.19.8 still reads: ``"zero_optimization": true`` (stage 1, ``allgather_size``),
  the ``bfloat16`` section, ``zero_optimization.cpu_offload`` / ``cpu_offload_param`` /
  ``cpu_offload_use_pin_memory``, ``stage3_gather_fp16_weights_on_model_save`` and the pydantic aliases
  without the ``stage3_`` prefix (``prefetch_bucket_size``, ...);
- settings DeepSpeed ignores (``offload_param`` below stage 3) are dropped with one warning;
- top-level sections removed in DeepSpeed 0.19.8 are refused with DeepSpeed's reason, and settings that
  would change training and are not built here are refused (`UNBUILT` lists them for docs/configs.md);
- ``"auto"`` values are resolved in `zero_offload.config.auto`.
"""
from __future__ import annotations

import warnings
from zero_offload.config.schema import ConfigError

__all__ = ["normalize", "UNBUILT", "REMOVED_IN_DEEPSPEED", "IGNORED_TOP_LEVEL", "IGNORED_COMPILE", "IGNORED_ZERO", "IGNORED_CHECKPOINT", "IGNORED_ACTIVATION_CHECKPOINTING",
           "IGNORED_OFFLOAD_OPTIMIZER", "IGNORED_OFFLOAD_PARAM"]

# Sections DeepSpeed 0.19.8 itself refuses (deepspeed/runtime/config.py, _REMOVED_TOP_LEVEL_CONFIG_KEYS).
REMOVED_IN_DEEPSPEED = {
    "nebula": "Nebula checkpointing was removed from DeepSpeed",
    "compression_training": "the DeepSpeed compression library was removed; the model would train unquantized",
    "amp": "NVIDIA Apex AMP integration was removed; use 'fp16' or 'bf16'",
    "quantize_training": "Mixture-of-Quantization was removed",
    "sparse_gradients": "sparse embedding-gradient compression was removed",
    "eigenvalue": "eigenvalue-based MoQ was removed",
    "sparse_attention": "DeepSpeed Sparse Attention was removed",
    "elasticity": "elastic training was removed; set the batch keys directly",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "top-level curriculum_learning was removed; use data_efficiency",
    "progressive_layer_drop": "Progressive Layer Dropping was removed",
}
REMOVED_ZERO_IN_DEEPSPEED = {
    "mics_shard_size": "MiCS ZeRO-3 sharding was removed from DeepSpeed",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding was removed from DeepSpeed",
    "zeropp_loco_param": "LoCo-Zero++ was removed from DeepSpeed",
}

# Settings that change what is trained and are not built here: refused, never ignored (docs/configs.md lists them).
UNBUILT = {
    "gradient_allreduce_op = 'sum'": "gradients are always averaged over ranks",
    "fp16.auto_cast = true": "inputs are not cast; cast them yourself (the model runs in fp16)",
    "fp16.fp16_master_weights_and_grads = true": "master weights are always fp32",
    "torch_autocast.enabled = true": "no autocast regions; use fp16 or bf16",
    "tensor_parallel.autotp_size > 1": "no tensor parallelism (data parallel only)",
    "data_efficiency.enabled = true": "no curriculum / random-LTD data sampling",
    "weight_quantization": "no quantized weights",
    "compile.deepcompile = true": "DeepCompile's graph passes (ZeRO inside the compiled graph, activation and "
                                  "optimizer-state offload) are not built; engine.compile() compiles the model with "
                                  "plain torch.compile, the engine's hooks between graphs",
    "optimizer.type OneBitAdam, OneBitLamb, ZeroOneAdam, Lion, MuAdam, MuAdamW, MuSGD":
        "use Adam/AdamW, Lamb, Muon or a torch.optim name (SGD, Adagrad, RMSprop, ...)",
}


# DeepSpeed 0.19.8's ``compile`` section configures DeepCompile (deepspeed/compile/config.py); DeepSpeed itself uses
# these keys only with ``deepcompile: true``, which is refused here (`UNBUILT`). Accepted with one warning.
_DEEPCOMPILE = "configures DeepCompile (used by DeepSpeed only with compile.deepcompile = true, refused here)"
IGNORED_COMPILE = {
    "free_activation": f"{_DEEPCOMPILE}: its eager freeing of activations",
    "free_activation_threshold": f"{_DEEPCOMPILE}: its eager freeing of activations",
    "offload_activation": f"{_DEEPCOMPILE}: its activation offload pass",
    "offload_activation_pin_memory": f"{_DEEPCOMPILE}: its activation offload pass",
    "offload_opt_states": f"{_DEEPCOMPILE}: its optimizer-state offload; use zero_optimization.offload_optimizer",
    "offload_parameters": f"{_DEEPCOMPILE}: its parameter offload; use zero_optimization.offload_param",
    "double_buffer": f"{_DEEPCOMPILE}: its all-gather buffers",
    "symmetric_memory": f"{_DEEPCOMPILE}: its all-gather buffers",
    "debug_log": f"{_DEEPCOMPILE}: its graph dumps (use TORCH_LOGS for torch.compile's)",
    "sync_before_reduce": f"{_DEEPCOMPILE}: synchronisation around its collectives",
    "sync_after_reduce": f"{_DEEPCOMPILE}: synchronisation around its collectives",
    "sync_before_allgather": f"{_DEEPCOMPILE}: synchronisation around its collectives",
    "sync_after_allgather": f"{_DEEPCOMPILE}: synchronisation around its collectives",
    "keep_int_input_tensors": f"{_DEEPCOMPILE}: the inputs its profiling keeps",
    "keep_all_input_tensors": f"{_DEEPCOMPILE}: the inputs its profiling keeps",
    "passes": f"{_DEEPCOMPILE}: its pass list (z1, z3, autosp, autotp)",
}

# DeepSpeed keys that change nothing here: accepted with one warning, so a DeepSpeed JSON runs unchanged.
IGNORED_TOP_LEVEL = {
    "wall_clock_breakdown": "timings are always in metrics.jsonl",
    "memory_breakdown": "use Engine.memory_breakdown()",
    "dump_state": "no state dump",
    "zero_allow_untested_optimizer": "every optimizer type that runs here is a tested one (the fused Adam, or a "
                                     "torch.optim class on the partitions)",
    "zero_force_ds_cpu_optimizer": "the host optimizer is always zero-offload's CPUAdam",
    "flops_profiler": "no profiler hooks",
    "tensorboard": "metrics go to metrics.jsonl",
    "wandb": "metrics go to metrics.jsonl",
    "csv_monitor": "metrics go to metrics.jsonl",
    "comms_logger": "no communication logger",
    "steps_per_print_dist": "only rank 0 prints",
    "steps_per_print": "the main job shows a progress bar and writes every step to metrics.jsonl",
    "comet": "metrics go to metrics.jsonl",
    "timers": "no DeepSpeed timers",
    "autotuning": "no autotuner; `zero-offload estimate` plans memory",
    "data_types": "gradients accumulate in fp32 at stages 2/3 and in the training dtype at stages 0/1",
    "hybrid_engine": "no inference hybrid engine",
    "pipeline": "no pipeline parallelism; the section only applies to a deepspeed.pipe.PipelineModule",
    "datastates": "no DataStates checkpoint engine",
    "disable_allgather": "updated parameters are always all-gathered",
    "disable_python_gc": "Python's garbage collector is left as it is",
    "managed_gradient_accumulation": "the engine always counts micro-steps to the accumulation boundary",
    "vocabulary_size": "only used by DeepSpeed for an alignment warning",
    "log_level": "zero-offload logs through Python warnings",
    "use_data_before_expert_parallelism": "no expert parallelism",
    "expert_parallel": "no expert parallelism",
    "seq_parallel_communication_data_type": "the Ulysses all-to-all moves activations in their own dtype",
    "tensor_parallel": "no tensor parallelism (autotp_size 1 is the same as none)",
    "torch_autocast": "autocast is off (enabled = false), as DeepSpeed's default",
    "data_efficiency": "data efficiency is off (enabled = false)",
}
# DeepSpeed 0.19.8's checkpoint keys (runtime/constants.py) and why they change nothing here.
IGNORED_CHECKPOINT = {
    "tag_validation": "every rank's tag is always checked against rank 0's, and a mismatch is an error",
    "load_universal": "a universal checkpoint is recognised by its layout and loaded into any stage and size",
    "use_node_local_storage": "every rank writes and reads its own shard file",
    "parallel_write": "every rank writes its own shard file in parallel; there is no pipeline parallelism",
    "writer": "no DeepSpeed checkpoint writer engines; files are written atomically by this package",
}
# DeepSpeed 0.19.8's activation_checkpointing keys other than cpu_checkpointing, and why they change nothing here.
IGNORED_ACTIVATION_CHECKPOINTING = {
    "partition_activations": "it splits activations across tensor-parallel ranks; there is no tensor parallelism",
    "contiguous_memory_optimization": "it packs partitioned activations; there is no tensor parallelism",
    "number_checkpoints": "it sizes the contiguous buffers of partitioned activations",
    "synchronize_checkpoint_boundary": "a profiling barrier; copies are ordered by events",
    "profile": "no checkpoint timers; engine.timings times forward and backward",
}
IGNORED_ZERO = {
    "reduce_scatter": "gradients are always reduced to their owning partition",
    "allgather_partitions": "parameters are always all-gathered from partitions",
    "round_robin_gradients": "partitions are contiguous ranges",
    "elastic_checkpoint": "checkpoints always reshard",
    "load_from_fp32_weights": "checkpoints always restore fp32 master weights",
    "ignore_unused_parameters": "unused parameters contribute zero gradients",
    "zero_hpz_partition_size": "no hierarchical partitioning",
    "zero_quantized_weights": "no quantized communication",
    "zero_quantized_gradients": "no quantized communication",
    "memory_efficient_linear": "no linear override",
    "stage3_module_granularity_threshold": "every module that owns parameters is its own gather unit",
    "stage3_model_persistence_threshold": "persistence is decided by stage3_param_persistence_threshold alone",
    "stage3_use_all_reduce_for_fetch_params": "parameters are fetched with all-gather",
    "stage3_allgather_sequential": "each module's parameters are gathered as one flat buffer",
    "use_multi_rank_bucket_allreduce": "buckets are reduced to their owning rank",
    "compute_grad_norm": "the global gradient norm is always computed (clipping and get_global_grad_norm)",
    "parameter_alignment": "flat buffers are always aligned",
    "legacy_stage1": "there is one stage-1 implementation",
    "zero_quantized_nontrainable_weights": "no quantized weights; frozen weights keep their dtype",
    "override_module_apply": "module.apply is not patched",
    "log_trace_cache_warnings": "the stage-3 fetch schedule warns once when the module order changes",
    "enable_sanity_checks": "no extra internal checks",
    "save_muon_momentum_buffer_in_memory": "Muon's momentum is kept where the optimizer states are (docs/muon.md)",
    "leaf_module": "every module that owns parameters is its own gather unit",
    "pipeline_loading_checkpoint": "no pipeline parallelism",
    "zenflow": "ZenFlow's stall-free offload is not built: the plain ZeRO-Offload host step runs instead",
}
IGNORED_OFFLOAD = {
    "ratio": "the whole optimizer step runs on the host when offloaded",
    "pipeline": "set pipeline_read / pipeline_write",
    "super_offload": "SuperOffload (Superchip CPU offload) is not built: the plain ZeRO-Offload host step "
                     "runs instead",
}
IGNORED_OFFLOAD_OPTIMIZER = {**{k: v for k, v in IGNORED_OFFLOAD.items() if k not in ("super_offload", "ratio")},
                             "buffer_size": "NVMe buffers hold one sub-group (sub_group_size) each",
                             "max_in_cpu": "a key of offload_param"}
IGNORED_OFFLOAD_PARAM = {**IGNORED_OFFLOAD,
                         "super_offload": "a key of offload_optimizer (the speculative host step)",
                         "ratio": "a key of offload_optimizer (the share of the optimizer state offloaded)",
                         "cpuadam_cores_perc": "a key of offload_optimizer",
                         "fast_init": "a key of offload_optimizer",
                         "pipeline_read": "a key of offload_optimizer",
                         "pipeline_write": "a key of offload_optimizer"}


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def _refuse(key: str, value, reason: str) -> None:
    raise ConfigError(f"config key '{key}': {value!r} is accepted by DeepSpeed but not implemented in "
                      f"zero-offload ({reason})")


def _refuse_unbuilt(data: dict) -> None:
    for key, reason in REMOVED_IN_DEEPSPEED.items():
        if key in data:
            raise ConfigError(f"config key '{key}' is refused, as DeepSpeed 0.19.8 refuses it: {reason}")
    zero = data.get("zero_optimization")
    if isinstance(zero, dict):
        for key, reason in REMOVED_ZERO_IN_DEEPSPEED.items():
            if key in zero:
                raise ConfigError(f"config key 'zero_optimization.{key}' is refused, as DeepSpeed 0.19.8 "
                                  f"refuses it: {reason}")
    op = data.get("gradient_allreduce_op", "mean")
    if op != "mean":
        if op == "sum":
            _refuse("gradient_allreduce_op", op, UNBUILT["gradient_allreduce_op = 'sum'"])
        raise ConfigError(f"config key 'gradient_allreduce_op': got {op!r}, allowed: 'mean', 'sum'")
    data.pop("gradient_allreduce_op", None)
    autocast = data.get("torch_autocast")
    if isinstance(autocast, dict) and autocast.get("enabled"):
        _refuse("torch_autocast.enabled", True, UNBUILT["torch_autocast.enabled = true"])
    tp = data.get("tensor_parallel")
    if isinstance(tp, dict) and int(tp.get("autotp_size", 1) or 1) > 1:
        _refuse("tensor_parallel.autotp_size", tp["autotp_size"], UNBUILT["tensor_parallel.autotp_size > 1"])
    de = data.get("data_efficiency")
    if isinstance(de, dict) and de.get("enabled"):
        _refuse("data_efficiency.enabled", True, UNBUILT["data_efficiency.enabled = true"])
    if data.get("weight_quantization"):
        _refuse("weight_quantization", "(section)", UNBUILT["weight_quantization"])


def _legacy_zero(data: dict) -> None:
    zero = data.get("zero_optimization")
    if isinstance(zero, bool):
        # deepspeed.runtime.zero.config.read_zero_config_deprecated
        new = {"stage": 1 if zero else 0}
        if zero:
            new["allgather_bucket_size"] = data.get("allgather_size", 500_000_000)
        data["zero_optimization"] = new
        data.pop("allgather_size", None)
        _warn(f"config key 'zero_optimization' = {str(zero).lower()} is DeepSpeed's deprecated form; read as "
              f"{new}")
        return
    if "allgather_size" in data:
        _warn("config key 'allgather_size' has no effect: DeepSpeed reads it only with the legacy "
              "'zero_optimization': true form; ignored")
        data.pop("allgather_size")
    if not isinstance(zero, dict):
        return
    # Pydantic aliases: DeepSpeed accepts the field names without the stage3_ prefix too.
    for short in ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                  "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                  "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential"):
        if short in zero:
            zero.setdefault(f"stage3_{short}", zero.pop(short))
    if "stage3_gather_fp16_weights_on_model_save" in zero:
        old = zero.pop("stage3_gather_fp16_weights_on_model_save")
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", old)
    # Deprecated offload switches, mapped as DeepSpeed's new_param_fn does.
    if zero.get("cpu_offload") is not None:
        if zero.pop("cpu_offload") and "offload_optimizer" not in zero:
            zero["offload_optimizer"] = {"device": "cpu"}
        _warn("config key 'zero_optimization.cpu_offload' is deprecated in DeepSpeed; read as "
              "offload_optimizer.device = 'cpu'")
    if zero.get("cpu_offload_param") is not None:
        if zero.pop("cpu_offload_param") and "offload_param" not in zero:
            zero["offload_param"] = {"device": "cpu"}
        _warn("config key 'zero_optimization.cpu_offload_param' is deprecated in DeepSpeed; read as "
              "offload_param.device = 'cpu'")
    if zero.get("cpu_offload_use_pin_memory") is not None:
        pin = zero.pop("cpu_offload_use_pin_memory")
        for key in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(key), dict):
                zero[key].setdefault("pin_memory", pin)
        _warn("config key 'zero_optimization.cpu_offload_use_pin_memory' is deprecated in DeepSpeed; read as "
              "pin_memory of the offload sections")
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key) is None and key in zero:
            zero.pop(key)                   # DeepSpeed's Optional[...] = None
    stage = zero.get("stage", 0)
    param = zero.get("offload_param")
    if isinstance(stage, int) and stage < 3 and isinstance(param, dict) and param.get("device", "none") != "none":
        # DeepSpeed-Chat sets offload_param at every stage; DeepSpeed reads it only at stage 3.
        _warn(f"config key 'zero_optimization.offload_param' has no effect at stage {stage}: parameters are "
              f"only partitioned (and offloaded) at stage 3, and DeepSpeed ignores it too; ignored")
        zero.pop("offload_param")


def _aliases(data: dict) -> None:
    if "bfloat16" in data:
        old = data.pop("bfloat16")
        if "bf16" in data:
            _warn("config key 'bfloat16' has no effect: 'bf16' is also given and DeepSpeed reads only 'bf16'")
        else:
            data["bf16"] = old


def _dotted_top_level(data: dict) -> None:
    """Drop top-level keys that spell a nested one with dots (``"zero_optimization.reduce_bucket_size"``, as TRL's
    ``prepare_deepspeed`` and accelerate's reference-model code write them): DeepSpeed 0.19.8 reads sections by
    name, so such a key changes nothing there either. One warning names them."""
    dotted = sorted(k for k in data if isinstance(k, str) and "." in k)
    if dotted:
        for key in dotted:
            data.pop(key)
        _warn(f"config keys {', '.join(repr(k) for k in dotted)} are dotted names at the top level; DeepSpeed "
              f"reads sections by name and ignores them, and so does zero-offload")


def normalize(data: dict) -> dict:
    """A copy of ``data`` with one spelling per key (see the module docstring).

    Raises:
        ConfigError: a key DeepSpeed 0.19.8 removed, or an unbuilt setting that would change training.
    """
    data = _deep_copy(data)
    _dotted_top_level(data)
    _refuse_unbuilt(data)
    _compile_section(data)
    _aliases(data)
    _legacy_zero(data)
    return data


def _compile_section(data: dict) -> None:
    """Take DeepSpeed's ``compile`` section out of ``data``: ``deepcompile: true`` and unknown keys refused, the
    DeepCompile keys accepted with one warning (`IGNORED_COMPILE`)."""
    section = data.pop("compile", None)
    if section is None:
        return
    if not isinstance(section, dict):
        raise ConfigError(f"config key 'compile' must be a section (a JSON object), got {section!r}")
    if section.get("deepcompile"):
        _refuse("compile.deepcompile", section["deepcompile"], UNBUILT["compile.deepcompile = true"])
    unknown = sorted(set(section) - set(IGNORED_COMPILE) - {"deepcompile"})
    if unknown:
        raise ConfigError(f"config key 'compile.{unknown[0]}' is not a key of DeepSpeed 0.19.8's compile section "
                          f"(known: deepcompile, {', '.join(IGNORED_COMPILE)})")
    given = [k for k in section if k in IGNORED_COMPILE]
    if given:
        _warn(f"config keys {', '.join('compile.' + k for k in given)} configure DeepCompile and have no effect "
              "here (nor in DeepSpeed without compile.deepcompile); engine.compile() compiles with torch.compile")


def _deep_copy(x):
    if isinstance(x, dict):
        return {k: _deep_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deep_copy(v) for v in x]
    return x
