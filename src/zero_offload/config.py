"""`Config`: the DeepSpeed-style JSON config as typed dataclasses.

Keys, meanings and defaults follow DeepSpeed's config documentation unless a field's help says otherwise.
Build one with `Config.load(dict | path | Config)`; batch sizes are resolved against the world size by
`Config.batch_sizes(world_size)`.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from zero_offload.config_schema import ConfigError, from_dict, option, to_dict

__all__ = ["Config", "ConfigError", "BatchSizes", "FP16Config", "BF16Config", "OptimizerConfig",
           "SchedulerConfig", "ZeroConfig", "OffloadConfig"]

# DeepSpeed keys that change nothing here: accepted with one warning, so a DeepSpeed JSON runs unchanged.
IGNORED_TOP_LEVEL = {
    "wall_clock_breakdown": "timings are always in metrics.jsonl",
    "memory_breakdown": "use Engine.memory_breakdown()",
    "dump_state": "no state dump",
    "zero_allow_untested_optimizer": "the optimizer is always zero-offload's own Adam",
    "zero_force_ds_cpu_optimizer": "the host optimizer is always zero-offload's CPUAdam",
    "flops_profiler": "no profiler hooks",
    "tensorboard": "metrics go to metrics.jsonl",
    "wandb": "metrics go to metrics.jsonl",
    "csv_monitor": "metrics go to metrics.jsonl",
    "comms_logger": "no communication logger",
    "steps_per_print_dist": "only rank 0 prints",
    "steps_per_print": "the main job shows a progress bar and writes every step to metrics.jsonl",
}
IGNORED_ZERO = {
    "reduce_scatter": "gradients are always reduced to their owning partition",
    "allgather_partitions": "parameters are always all-gathered from partitions",
    "round_robin_gradients": "partitions are contiguous ranges",
    "elastic_checkpoint": "checkpoints always reshard",
    "load_from_fp32_weights": "checkpoints always restore fp32 master weights",
    "ignore_unused_parameters": "unused parameters contribute zero gradients",
    "stage3_gather_16bit_weights_on_model_save": "use Engine.full_state_dict()",
    "stage3_gather_fp16_weights_on_model_save": "use Engine.full_state_dict()",
    "zero_hpz_partition_size": "no hierarchical partitioning",
    "zero_quantized_weights": "no quantized communication",
    "zero_quantized_gradients": "no quantized communication",
    "memory_efficient_linear": "no linear override",
    "sub_group_size": "the host step streams the partition in cache-sized chunks by itself",
}
IGNORED_OFFLOAD = {
    "buffer_count": "host buffers are sized from reduce_bucket_size",
    "buffer_size": "host buffers are sized from reduce_bucket_size",
    "max_in_cpu": "all offloaded partitions stay in host memory",
    "fast_init": "host state is always initialised in place",
    "ratio": "the whole optimizer step runs on the host when offloaded",
    "pipeline": "read-ahead is always on",
    "pipeline_read": "read-ahead is always on",
    "pipeline_write": "write-behind is always on",
}


@dataclass
class FP16Config:
    enabled: bool = option(False, "Train with fp16 parameters, fp32 master weights and loss scaling.")
    loss_scale: float = option(0.0, "Static loss scale; 0 selects dynamic loss scaling.", min=0.0)
    initial_scale_power: int = option(16, "Dynamic scaling starts at 2**initial_scale_power.", min=0, max=64)
    loss_scale_window: int = option(1000, "Clean steps before the dynamic scale doubles.", min=1)
    hysteresis: int = option(2, "Overflows tolerated before the scale is halved.", min=1)
    consecutive_hysteresis: bool = option(False, "Refill hysteresis after every clean step (DeepSpeed's flag).")
    min_loss_scale: float = option(1.0, "The dynamic scale never drops below this.", min=0.0, min_exclusive=True)
    auto_cast: bool = option(False, "Accepted for DeepSpeed compatibility; inputs are not cast.",
                             not_implemented={True: "cast inputs yourself; the model runs in fp16"})


@dataclass
class BF16Config:
    enabled: bool = option(False, "Train with bf16 parameters and fp32 master weights (no loss scaling).")


@dataclass
class AdamParams:
    lr: float = option(1e-3, "Learning rate (the schedule's max when a scheduler sets it).", min=0.0)
    betas: tuple[float, float] = option((0.9, 0.999), "Adam's (beta1, beta2).")
    eps: float = option(1e-8, "Added to the denominator for numerical stability.", min=0.0)
    weight_decay: float = option(0.0, "Decoupled (AdamW) or L2 (Adam) weight decay.", min=0.0)
    adam_w_mode: bool = option(True, "Decoupled weight decay (AdamW); false adds L2 decay to the gradient.")
    bias_correction: bool = option(True, "Adam's bias correction of both moments.")
    torch_adam: bool = option(False, "Accepted for DeepSpeed compatibility; the host kernel is always ours.")

    def validate(self, path):
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ConfigError(f"config key '{path}.betas[{i}]': got {b!r}, must be in [0, 1)")


@dataclass
class OptimizerConfig:
    type: Literal["Adam", "AdamW"] = option("Adam", "Adam or AdamW (AdamW forces adam_w_mode = true).")
    params: AdamParams = option(factory=AdamParams, help="The optimizer's hyper-parameters.")

    def validate(self, path):
        if self.type == "AdamW" and not self.params.adam_w_mode:
            raise ConfigError(f"config key '{path}.params.adam_w_mode': false contradicts "
                              f"'{path}.type' = 'AdamW'; use type 'Adam' for L2 weight decay")


@dataclass
class WarmupLRParams:
    warmup_min_lr: float = option(0.0, "Learning rate at the first step.", min=0.0)
    warmup_max_lr: float = option(0.001, "Learning rate reached after warmup.", min=0.0)
    warmup_num_steps: int = option(1000, "Steps of warmup.", min=1)
    warmup_type: Literal["log", "linear"] = option("log", "Shape of the warmup curve.")


@dataclass
class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: int = option(None, "Steps until the rate has decayed linearly to 0 (required).", min=1)

    def validate(self, path):
        if self.total_num_steps is None:
            raise ConfigError(f"config key '{path}.total_num_steps' is required for WarmupDecayLR")


@dataclass
class WarmupCosineLRParams:
    total_num_steps: int = option(None, "Steps of the whole schedule (required).", min=1)
    warmup_min_ratio: float = option(0.0, "Start of warmup as a fraction of the optimizer's lr.", min=0.0)
    warmup_num_steps: int = option(1000, "Steps of warmup.", min=1)
    cos_min_ratio: float = option(0.0001, "End of the cosine decay as a fraction of the optimizer's lr.",
                                  min=0.0)
    warmup_type: Literal["log", "linear"] = option("log", "Shape of the warmup curve.")

    def validate(self, path):
        if self.total_num_steps is None:
            raise ConfigError(f"config key '{path}.total_num_steps' is required for WarmupCosineLR")


SCHEDULER_PARAMS = {"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
                    "WarmupCosineLR": WarmupCosineLRParams}


@dataclass
class SchedulerConfig:
    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = option(
        None, "The learning-rate schedule, stepped with every optimizer step (DeepSpeed's names).")
    params: Any = option(factory=dict, help="The schedule's parameters, as DeepSpeed names them.")

    def validate(self, path):
        if self.type is None:
            raise ConfigError(f"config key '{path}.type' is required; allowed: {', '.join(SCHEDULER_PARAMS)}")
        if not isinstance(self.params, dict):
            raise ConfigError(f"config key '{path}.params': got {self.params!r}, expected an object")
        self.params = from_dict(SCHEDULER_PARAMS[self.type], self.params, f"{path}.params")


@dataclass
class OffloadConfig:
    IGNORED: ClassVar[dict[str, str]] = IGNORED_OFFLOAD
    device: Literal["none", "cpu", "nvme"] = option(
        "none", "Where the partition lives: the accelerator (none), host memory (cpu) or NVMe files.",
        not_implemented={"nvme": "NVMe offload is a later issue; use 'cpu'"})
    nvme_path: str | None = option(None, "Directory for NVMe swap files (device = nvme).")
    pin_memory: bool = option(False, "Page-lock the host buffers (gradient partition, master weights, "
                                     "parameter staging) so copies to and from the GPU run asynchronously on "
                                     "the copy stream; without it each copy blocks the host. Recommended on "
                                     "GPUs; DeepSpeed's default (false) is kept.")


@dataclass
class ZeroConfig:
    IGNORED: ClassVar[dict[str, str]] = IGNORED_ZERO
    stage: int = option(0, "0: data parallel; 1: partition optimizer states; 2: and gradients; "
                           "3: and parameters.", min=0, max=3)
    offload_optimizer: OffloadConfig = option(factory=OffloadConfig,
                                              help="Keep optimizer states and run the step on the host.")
    offload_param: OffloadConfig = option(factory=OffloadConfig, help="Keep 16-bit parameter partitions on "
                                                                      "the host (stage 3 only).")
    contiguous_gradients: bool = option(True, "Copy gradients into contiguous buckets as they are produced. "
                                              "Always on here; false is accepted with a warning.")
    overlap_comm: bool = option(False, "Reduce full buckets asynchronously while backward continues; false "
                                       "waits for each reduction before backward goes on.")
    cpu_offload: bool = option(False, "DeepSpeed's legacy switch; true is refused with the key to use instead.",
                               not_implemented={True: "the legacy key; set offload_optimizer.device = 'cpu'"})
    reduce_bucket_size: int = option(500_000_000, "Elements per gradient bucket (stages 0-2; stage 3 "
                                                  "reduce-scatters each module's gradients as soon as they are "
                                                  "complete, which measured faster than one late bucket).",
                                     min=1)
    allgather_bucket_size: int = option(500_000_000, "Elements per all-gather of updated parameters.", min=1)
    stage3_prefetch_bucket_size: int = option(50_000_000, "Stage 3: elements prefetched ahead.", min=0)
    stage3_param_persistence_threshold: int = option(100_000, "Stage 3: parameters this small stay gathered.",
                                                     min=0)
    stage3_max_live_parameters: int = option(1_000_000_000, "Stage 3: most elements gathered at once.", min=0)
    stage3_max_reuse_distance: int = option(1_000_000_000, "Stage 3: keep a parameter gathered if reused "
                                                           "within this many elements.", min=0)

    def validate(self, path):
        if self.offload_param.device != "none" and self.stage < 3:
            raise ConfigError(f"config key '{path}.offload_param.device' = {self.offload_param.device!r} needs "
                              f"'{path}.stage' = 3 (got {self.stage}); parameters are only partitioned at "
                              f"stage 3")
        if self.offload_optimizer.device != "none" and self.stage < 1:
            raise ConfigError(f"config key '{path}.offload_optimizer.device' = "
                              f"{self.offload_optimizer.device!r} needs '{path}.stage' >= 1 (got 0)")


@dataclass(frozen=True)
class BatchSizes:
    """The resolved batch arithmetic: train_batch_size = micro_batch x gradient_accumulation x world_size."""
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int


@dataclass
class Config:
    IGNORED: ClassVar[dict[str, str]] = IGNORED_TOP_LEVEL
    train_batch_size: int | None = option(None, "Samples per optimizer step over all ranks.", min=1)
    train_micro_batch_size_per_gpu: int | None = option(None, "Samples per forward/backward on one rank.",
                                                        min=1)
    gradient_accumulation_steps: int | None = option(None, "Micro-batches per optimizer step.", min=1)
    gradient_clipping: float = option(0.0, "Clip the global gradient norm to this; 0 disables.", min=0.0)
    seed: int | None = option(None, "Not a DeepSpeed key: seeds torch on every rank when given.")
    fp16: FP16Config = option(factory=FP16Config, help="fp16 mixed precision with loss scaling.")
    bf16: BF16Config = option(factory=BF16Config, help="bf16 mixed precision.")
    optimizer: OptimizerConfig = option(factory=OptimizerConfig, help="The optimizer (Adam or AdamW).")
    scheduler: SchedulerConfig | None = option(None, "The learning-rate schedule; none keeps lr fixed.")
    zero_optimization: ZeroConfig = option(factory=ZeroConfig, help="ZeRO stage and offload settings.")

    def validate(self, path):
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("config keys 'fp16.enabled' and 'bf16.enabled' are both true; choose one")

    @classmethod
    def load(cls, source: "Config | dict | str | os.PathLike") -> "Config":
        """Build a Config from a dict, a path to a JSON file, or return a Config as is.

        Raises:
            ConfigError: an unreadable or invalid JSON file (naming it), or any invalid key or value.
        """
        if isinstance(source, Config):
            return source
        if isinstance(source, (str, os.PathLike)):
            try:
                with open(source, encoding="utf-8") as f:
                    data = json.load(f)
            except OSError as e:
                raise ConfigError(f"config file '{source}' cannot be read: {e.strerror}") from e
            except json.JSONDecodeError as e:
                raise ConfigError(f"config file '{source}' is not valid JSON: {e}") from e
            return cls.from_dict(data)
        if isinstance(source, dict):
            return cls.from_dict(source)
        raise ConfigError(f"config must be a dict, a JSON file path or a zero_offload.Config, got "
                          f"{type(source).__name__}")

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        """Build and validate a Config from DeepSpeed-style JSON data (see `Config.load`)."""
        cfg = from_dict(cls, data)
        if not cfg.zero_optimization.contiguous_gradients:
            warnings.warn("config key 'zero_optimization.contiguous_gradients' = false has no effect: "
                          "gradients are always copied into contiguous buckets", stacklevel=2)
        if cfg.optimizer.params.torch_adam:
            warnings.warn("config key 'optimizer.params.torch_adam' has no effect: the host step always "
                          "uses zero-offload's kernel", stacklevel=2)
        return cfg

    def to_dict(self) -> dict:
        return to_dict(self)

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def batch_sizes(self, world_size: int) -> BatchSizes:
        """Resolve the three batch keys as DeepSpeed does: any two fix the third.

        Raises:
            ConfigError: none of the keys is given, or they do not multiply out with ``world_size``
                (the message names all three and the world size).
        """
        train, micro, gas = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                             self.gradient_accumulation_steps)
        given = (f"train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
                 f"gradient_accumulation_steps={gas}, world size={world_size}")
        if train is None and micro is None:
            raise ConfigError("config needs 'train_batch_size' or 'train_micro_batch_size_per_gpu' "
                              f"(got {given})")
        if train is not None and micro is not None and gas is None:
            gas, rem = divmod(train, micro * world_size)
            if rem or gas == 0:
                raise ConfigError(f"config batch sizes do not divide: train_batch_size must be a multiple of "
                                  f"train_micro_batch_size_per_gpu x world size ({given})")
        elif train is not None and micro is None:
            gas = gas or 1
            micro, rem = divmod(train, gas * world_size)
            if rem or micro == 0:
                raise ConfigError(f"config batch sizes do not divide: train_batch_size must be a multiple of "
                                  f"gradient_accumulation_steps x world size ({given})")
        elif train is None:
            gas = gas or 1
            train = micro * gas * world_size
        if train != micro * gas * world_size:
            raise ConfigError(f"config batch sizes are inconsistent: train_batch_size must equal "
                              f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size "
                              f"({given})")
        return BatchSizes(train, micro, gas)

