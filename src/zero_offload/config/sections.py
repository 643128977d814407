"""`Config`: the DeepSpeed-style JSON config as typed dataclasses.

Keys, meanings and defaults follow DeepSpeed's config documentation unless a field's help says otherwise.
Build one with `Config.load(dict | path | Config)`; batch sizes are resolved against the world size by
`Config.batch_sizes(world_size)`.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import ClassVar, Literal

from zero_offload.config.auto import AutoContext, resolve_auto
from zero_offload.config.activation_checkpointing import ActivationCheckpointingConfig
from zero_offload.config.checkpointing import CheckpointConfig
from zero_offload.config.compat import (IGNORED_OFFLOAD, IGNORED_OFFLOAD_OPTIMIZER, IGNORED_OFFLOAD_PARAM,
                                       IGNORED_TOP_LEVEL, IGNORED_ZERO, normalize)
from zero_offload.config.io import check_finite, decode_config_string, read_config_file
from zero_offload.config.precision import BF16Config, FP16Config, bf16_moments_from_optimizer, check_master_weights
from zero_offload.config.optim import (SCHEDULER_PARAMS, AdamParams, check_muon, LRRangeTestParams, OneCycleParams,
                                       OptimizerConfig, SchedulerConfig, WarmupCosineLRParams,
                                       WarmupDecayLRParams, WarmupLRParams, check_fused_kernel_keys)
from zero_offload.config.aio import AioConfig
from zero_offload.config.schema import ConfigError, from_dict, option, to_dict

__all__ = ["Config", "ConfigError", "BatchSizes", "FP16Config", "BF16Config", "OptimizerConfig",
           "SchedulerConfig", "ZeroConfig", "OffloadConfig", "AutoContext", "AdamParams", "WarmupLRParams",
           "WarmupDecayLRParams", "WarmupCosineLRParams", "OneCycleParams", "LRRangeTestParams", "SCHEDULER_PARAMS",
           "OffloadOptimizerConfig", "OffloadParamConfig", "AioConfig"]


@dataclass
class OffloadConfig:
    IGNORED: ClassVar[dict[str, str]] = IGNORED_OFFLOAD
    device: Literal["none", "cpu", "nvme"] = option(
        "none", "Where the partition lives: the accelerator (none), host memory (cpu) or NVMe files "
                "(nvme: swap files under nvme_path, ZeRO-Infinity).")
    nvme_path: str | None = option(None, "Directory for NVMe swap files (device = nvme); files go to "
                                         "nvme_path/zero_offload/rank{r}/ and are removed at exit.")
    pin_memory: bool = option(True, "Page-lock the host buffers that are copied asynchronously (gradient "
                                    "partition, parameter staging, host parameter shards), at their exact size, "
                                    "so copies to and from the GPU overlap compute; DeepSpeed's default (true).")
    delayed_param_update: bool = option(False, "offload_optimizer only, not a DeepSpeed key: the delayed "
                                               "parameter update of the ZeRO-Offload paper (Sec. 5.2). After "
                                               "dpu_warmup_steps, the host step of step t runs in a background "
                                               "thread while step t+1's forward and backward run on the "
                                               "parameters of step t-1.")
    dpu_warmup_steps: int = option(40, "offload_optimizer only: optimizer steps taken synchronously before the "
                                       "delayed parameter update starts (the paper's warm-up).", min=0)


@dataclass
class OffloadOptimizerConfig(OffloadConfig):
    IGNORED: ClassVar[dict[str, str]] = IGNORED_OFFLOAD_OPTIMIZER
    buffer_count: int = option(4, "NVMe: the most aligned host buffers in the pool the optimizer states stream "
                                  "through, each one sub-group's master weights and both moments; the pool holds "
                                  "the ones in flight, 1 + pipeline_read + pipeline_write, so host memory for "
                                  "optimizer state is that many x 12 bytes x sub_group_size. Needs at least "
                                  "1 + pipeline_read + pipeline_write.", min=0)
    cpuadam_cores_perc: float = option(0.8, "The share of this process's cores a host optimizer step running "
                                            "beside training (the delayed update) uses: its kernel's thread "
                                            "count (at least 1) and the cores its thread is pinned to; the rest "
                                            "feed the device. A synchronous step uses every core. DeepSpeed's "
                                            "key and default.", min=0.0, max=1.0)
    pipeline_read: bool = option(False, "NVMe: read sub-group i+1 while sub-group i is stepped.")
    pipeline_write: bool = option(False, "NVMe: write sub-group i-1 while sub-group i is stepped.")
    fast_init: bool = option(False, "NVMe: accepted (DeepSpeed's switch); initialisation always writes only "
                                     "the master weights and leaves the zero moments as sparse files.")
    super_offload: bool = option(False, "SuperOffload's speculative host step (DeepSpeed 0.18+'s key), at "
                                        "stages 2 and 3 with device 'cpu': each piece of the partition is stepped "
                                        "while backward still runs, into a second bank of master weights and "
                                        "moments (12 bytes/param more host memory, 8 with bf16 moments); the "
                                        "boundary keeps it, or redoes it exactly when clipping fired, or drops it "
                                        "on fp16 overflow. Not with delayed_param_update.")
    super_offload_fraction: float = option(1.0, "Not a DeepSpeed key: with super_offload and device 'cpu', the share "
                                                "of each partition speculated, the first to land: 1 into a second "
                                                "bank; below 1 in place after an undo copy (f x 12 bytes/param, 8 "
                                                "with bf16 moments), the rest after backward.", min=0.0, max=1.0)
    ratio: float = option(1.0, "ZeRO-Offload++'s Twin-Flow (DeepSpeed's key and default): the share of each "
                               "partition whose optimizer state and step are offloaded, at stages 2 and 3 with "
                               "device 'cpu' and the parameters on the device. The rest keeps its fp32 masters, "
                               "moments and gradient on the device and is stepped there at the boundary, while the "
                               "host steps its part; one global norm and clip coefficient for both.",
                          min=0.0, max=1.0)
    gradients_on_device: bool = option(False, "Not a DeepSpeed key: with device 'cpu', keep this rank's reduced "
                                              "gradient partition on the accelerator (accumulated there over "
                                              "micro-steps) and pull it down chunk by chunk while the host step "
                                              "runs, through a few pinned chunks. Host memory less by the "
                                              "partition (2 bytes/param in 16 bits, 4 under fp32 accumulation), "
                                              "device memory more by as much at stages 2 and 3 (at stage 1 it is "
                                              "the full gradient the device holds anyway). Same update, bit for "
                                              "bit; the synchronous host step only.")
    copy_chunk: int = option(1 << 24, "Not a DeepSpeed key: elements per chunk of the host step and per copy up of "
                                      "the updated parameters it starts (16M: 32 MB in 16 bits). Each finished "
                                      "chunk's copy starts at once, overlapping the rest of the step; smaller chunks "
                                      "start it sooner, larger ones queue fewer copies and events.", min=1)


@dataclass
class OffloadParamConfig(OffloadConfig):
    IGNORED: ClassVar[dict[str, str]] = IGNORED_OFFLOAD_PARAM
    device: Literal["none", "cpu", "nvme"] = option(
        "none", "Where the 16-bit parameter partitions live: the accelerator (none), host memory (cpu) or swap "
                "files under nvme_path, read ahead into a small host pool (nvme, ZeRO-Infinity).")
    buffer_count: int = option(5, "NVMe: buffers in the parameter pool, each holding one unit's partition "
                                  "(DeepSpeed's default).", min=0)
    buffer_size: int = option(100_000_000, "NVMe: most elements per parameter buffer; every unit's partition "
                                           "must fit (DeepSpeed's default). The pool allocates the largest "
                                           "unit partition per buffer, at most this.", min=0)
    max_in_cpu: int = option(1_000_000_000, "NVMe: most parameter elements read ahead into host memory.", min=0)


@dataclass
class ZeroConfig:
    IGNORED: ClassVar[dict[str, str]] = IGNORED_ZERO
    stage: int = option(0, "0: data parallel; 1: partition optimizer states; 2: and gradients; "
                           "3: and parameters.", min=0, max=3)
    offload_optimizer: OffloadOptimizerConfig = option(
        factory=OffloadOptimizerConfig, help="Keep optimizer states on the host or NVMe and run the step on the host.")
    offload_param: OffloadParamConfig = option(
        factory=OffloadParamConfig, help="Keep 16-bit parameter partitions on the host (stage 3 only).")
    sub_group_size: int = option(1_000_000_000, "Elements per sub-group of a rank's optimizer partition: the "
                                                "unit the NVMe host step reads, steps and writes.", min=1)
    contiguous_gradients: bool = option(True, "Copy gradients into contiguous buckets as they are produced. "
                                              "Always on here; false is accepted with a warning.")
    overlap_comm: bool | None = option(None, "Reduce full buckets asynchronously while backward continues; "
                                             "false waits for each reduction before backward goes on. Default "
                                             "(as DeepSpeed 0.19.8): true at stage 3, else false.")
    stage3_gather_16bit_weights_on_model_save: bool = option(
        False, "Stage 3: `save_16bit_model` gathers the 16-bit weights to rank 0 and writes them (without it, "
               "DeepSpeed writes nothing at stage 3 and so does zero-offload, with a warning).")
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

    def __post_init__(self):
        if self.overlap_comm is None:            # DeepSpeed 0.19.8's dynamic default
            self.overlap_comm = self.stage == 3

    def validate(self, path):
        if self.offload_param.device != "none" and self.stage < 3:
            raise ConfigError(f"config key '{path}.offload_param.device' = {self.offload_param.device!r} needs "
                              f"'{path}.stage' = 3 (got {self.stage}); parameters are only partitioned at "
                              f"stage 3")
        if self.offload_param.delayed_param_update:
            raise ConfigError(f"config key '{path}.offload_param.delayed_param_update' is not allowed; set "
                              f"'{path}.offload_optimizer.delayed_param_update' (the optimizer step is delayed)")
        if self.offload_optimizer.delayed_param_update and self.offload_optimizer.device != "cpu":
            raise ConfigError(f"config key '{path}.offload_optimizer.delayed_param_update' = true needs "
                              f"'{path}.offload_optimizer.device' = 'cpu' (got "
                              f"{self.offload_optimizer.device!r}): the delayed update overlaps the host step")
        if self.offload_optimizer.delayed_param_update and self.offload_param.device == "nvme":
            raise ConfigError(f"config key '{path}.offload_optimizer.delayed_param_update' = true needs the "
                              f"parameters in memory; '{path}.offload_param.device' is 'nvme'")
        if self.offload_optimizer.super_offload:
            self._check_super_offload(path)
        if self.offload_optimizer.ratio < 1.0:
            self._check_ratio(path)
        if self.offload_optimizer.super_offload_fraction < 1.0:
            self._check_super_offload_fraction(path)
        if self.offload_optimizer.gradients_on_device:
            self._check_gradients_on_device(path)
        for key, off in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)):
            if off.device != "nvme":
                continue
            if key == "offload_optimizer" and self.stage < 2:
                raise ConfigError(f"config key '{path}.{key}.device' = 'nvme' needs '{path}.stage' 2 or 3 (got "
                                  f"{self.stage}); as in DeepSpeed's ZeRO-Infinity, use 'cpu' at stage {self.stage}")
            if not off.nvme_path:
                raise ConfigError(f"config key '{path}.{key}.nvme_path' is required with '{path}.{key}.device' "
                                  "= 'nvme'")
        oo = self.offload_optimizer
        need = 1 + oo.pipeline_read + oo.pipeline_write
        if oo.device == "nvme" and oo.buffer_count < need:
            raise ConfigError(f"config key '{path}.offload_optimizer.buffer_count': got {oo.buffer_count}, needs "
                              f">= {need} (one sub-group stepped, plus one read ahead with pipeline_read and one "
                              "written behind with pipeline_write)")

    def _check_ratio(self, path: str) -> None:
        """``offload_optimizer.ratio`` < 1 splits a host step of stages 2/3 over device parameters."""
        key = f"config key '{path}.offload_optimizer.ratio' = {self.offload_optimizer.ratio}"
        if self.offload_optimizer.ratio <= 0.0:
            raise ConfigError(f"{key} offloads nothing: set '{path}.offload_optimizer.device' = 'none' instead")
        if self.offload_optimizer.delayed_param_update:
            raise ConfigError(f"{key} and '{path}.offload_optimizer.delayed_param_update' = true do not combine: the "
                              "device part would step on this step's gradients and the host part one step behind")
        if self.stage < 2:
            raise ConfigError(f"{key} needs '{path}.stage' 2 or 3 (got {self.stage})")
        if self.offload_optimizer.device == "none":
            raise ConfigError(f"{key} needs '{path}.offload_optimizer.device' = 'cpu' or 'nvme' (got 'none')")
        if self.offload_param.device != "none":
            raise ConfigError(f"{key} needs the parameters on the device; '{path}.offload_param.device' is "
                              f"{self.offload_param.device!r} (the device part steps device parameters)")

    def _check_gradients_on_device(self, path: str) -> None:
        """``offload_optimizer.gradients_on_device`` needs the synchronous host step over states in host memory."""
        oo = self.offload_optimizer
        key = f"config key '{path}.offload_optimizer.gradients_on_device' = true"
        if oo.device != "cpu":
            raise ConfigError(f"{key} needs '{path}.offload_optimizer.device' = 'cpu' (got {oo.device!r}): without "
                              "offload the gradient partition is on the device already; on NVMe the states stream "
                              "by sub-group and read the gradient from host memory")
        others = (("delayed_param_update", oo.delayed_param_update, "its step reads the gradients while the next "
                   "backward rewrites them"),
                  ("super_offload", oo.super_offload, "it steps each piece as it lands in host memory"),
                  ("ratio", oo.ratio < 1.0, "its device part already keeps its gradient on the device"))
        for other, on, why in others:
            if on:
                raise ConfigError(f"{key} and '{path}.offload_optimizer.{other}' do not combine: {why}")
        if self.offload_param.device == "nvme":
            raise ConfigError(f"{key} needs the parameters in memory; '{path}.offload_param.device' is 'nvme'")

    def _check_super_offload_fraction(self, path: str) -> None:
        """``offload_optimizer.super_offload_fraction`` < 1 sizes the speculation of states in host memory."""
        oo = self.offload_optimizer
        key = f"config key '{path}.offload_optimizer.super_offload_fraction' = {oo.super_offload_fraction}"
        if oo.super_offload_fraction <= 0.0:
            raise ConfigError(f"{key} speculates nothing: set '{path}.offload_optimizer.super_offload' = false")
        if not oo.super_offload:
            raise ConfigError(f"{key} has no effect without '{path}.offload_optimizer.super_offload' = true")
        if oo.device != "cpu":
            raise ConfigError(f"{key} needs '{path}.offload_optimizer.device' = 'cpu' (got {oo.device!r}): on NVMe "
                              "the second bank is a second set of swap files, not host memory")

    def _check_super_offload(self, path: str) -> None:
        """``offload_optimizer.super_offload`` needs the host step of stages 2/3 (states in host memory or NVMe)."""
        key = f"config key '{path}.offload_optimizer.super_offload' = true"
        if self.offload_optimizer.delayed_param_update:
            raise ConfigError(f"{key} and '{path}.offload_optimizer.delayed_param_update' = true do not combine: "
                              "the speculative step is exact, the delayed update trains one step stale; choose one")
        if self.stage < 2:
            raise ConfigError(f"{key} needs '{path}.stage' 2 or 3 (got {self.stage}): the pieces are stepped as "
                              "stage 2/3 reduce them during backward")
        if self.offload_optimizer.device == "none":
            raise ConfigError(f"{key} needs '{path}.offload_optimizer.device' = 'cpu' or 'nvme' (got 'none'): it "
                              "hides the host step")
        if self.offload_param.device == "nvme":
            raise ConfigError(f"{key} needs the parameters in memory; '{path}.offload_param.device' is 'nvme'")


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
    prescale_gradients: bool = option(False, "Divide gradients by the world size before they are summed "
                                             "across ranks instead of after (DeepSpeed's prescale_gradients).")
    gradient_predivide_factor: float = option(1.0, "Divide gradients by this before they are summed and by "
                                                   "world size / factor after (DeepSpeed's meaning; ignored "
                                                   "with prescale_gradients).", min=0.0, min_exclusive=True)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = option(
        None, "The dtype gradients are reduced in; unset (DeepSpeed's default) reduces in the training dtype.")
    dataloader_drop_last: bool = option(False, "The compat dataloader (zero_offload.deepspeed.initialize "
                                               "with training_data) drops the last incomplete batch.")
    sequence_parallel_size: int = option(1, "Ranks that share one sequence (Ulysses sequence parallelism; "
                                            "docs/long-sequences.md); the world size must be a multiple.", min=1)
    seed: int | None = option(None, "Not a DeepSpeed key: seeds torch on every rank when given.")
    fp16: FP16Config = option(factory=FP16Config, help="fp16 mixed precision with loss scaling.")
    bf16: BF16Config = option(factory=BF16Config, help="bf16 mixed precision.")
    optimizer: OptimizerConfig | None = option(None, "The optimizer (Adam or AdamW); required: there is no "
                                                     "default optimizer.")
    scheduler: SchedulerConfig | None = option(None, "The learning-rate schedule; none keeps lr fixed.")
    zero_optimization: ZeroConfig = option(factory=ZeroConfig, help="ZeRO stage and offload settings.")
    aio: AioConfig = option(factory=AioConfig, help="How NVMe swap files are read and written (DeepSpeed's "
                                                    "aio block).")
    activation_checkpointing: ActivationCheckpointingConfig = option(
        factory=ActivationCheckpointingConfig, help="Activation checkpoints: cpu_checkpointing keeps checkpoint inputs "
                                                    "in host memory.")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, help="Checkpoint loading: whether pickled "
                                                                         "client state is trusted.")

    def validate(self, path):
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("config keys 'fp16.enabled' and 'bf16.enabled' are both true; choose one")
        bf16_moments_from_optimizer(self)
        check_master_weights(self)
        check_muon(self)
        check_fused_kernel_keys(self)

    @classmethod
    def load(cls, source: "Config | dict | str | os.PathLike", auto: "AutoContext | None" = None) -> "Config":
        """Build a Config from a dict, a path to a JSON/hjson file (read as DeepSpeed reads it), a base64-encoded
        config string (DeepSpeed accepts one), or return a Config as is.

        ``auto`` tells how to resolve Hugging Face ``"auto"`` values (see `zero_offload.config.auto.resolve_auto`);
        without it an ``"auto"`` that needs the model or the device is an error naming the key.

        Raises:
            ConfigError: an unreadable, binary or invalid file (naming it), a duplicate key, NaN or
                Infinity (naming the key), or any invalid key or value.
        """
        if isinstance(source, Config):
            return source
        if isinstance(source, (str, os.PathLike)):
            if isinstance(source, str) and not os.path.exists(source):
                decoded = decode_config_string(source)
                if decoded is not None:
                    return cls.from_dict(decoded, auto)
            return cls.from_dict(read_config_file(source), auto)
        if isinstance(source, dict):
            check_finite(source)
            return cls.from_dict(source, auto)
        raise ConfigError(f"config must be a dict, a JSON file path or a zero_offload.Config, got "
                          f"{type(source).__name__}")

    @classmethod
    def from_dict(cls, data: dict, auto: "AutoContext | None" = None) -> "Config":
        """Build and validate a Config from DeepSpeed-style JSON data (see `Config.load`)."""
        data = resolve_auto(normalize(data), auto)
        cfg = from_dict(cls, data)
        for message in cfg.no_effect_warnings():
            warnings.warn(message, stacklevel=3)
        return cfg

    def no_effect_warnings(self) -> list[str]:
        """One message per set value that is accepted for DeepSpeed compatibility but changes nothing here."""
        out = []
        if not self.zero_optimization.contiguous_gradients:
            out.append("config key 'zero_optimization.contiguous_gradients' = false has no effect: "
                       "gradients are always copied into contiguous buckets")
        if self.optimizer is not None and self.optimizer.type in ("Adam", "AdamW") and \
                self.optimizer.params.torch_adam:
            out.append("config key 'optimizer.params.torch_adam' has no effect: the host step always "
                       "uses zero-offload's kernel")
        if self.bf16.immediate_grad_update:
            out.append("config key 'bf16.immediate_grad_update' has no effect: gradients always go straight to "
                       "their partition")
        if self.bf16.bf16_optimizer_states and self.zero_optimization.offload_optimizer.device == "none":
            out.append("config key 'bf16.bf16_optimizer_states' has no effect without "
                       "'zero_optimization.offload_optimizer.device' 'cpu' or 'nvme': the device Adam keeps fp32 "
                       "moments")
        if self.prescale_gradients and self.gradient_predivide_factor != 1.0:
            out.append("config key 'gradient_predivide_factor' has no effect with 'prescale_gradients' = true "
                       "(as in DeepSpeed)")
        return out

    def to_dict(self) -> dict:
        out = to_dict(self)
        if self.optimizer is None:
            out.pop("optimizer")
        elif self.optimizer.torch_kwargs is not None:
            out["optimizer"]["params"] = dict(self.optimizer.torch_kwargs)
        if self.scheduler is None:
            out.pop("scheduler")
        return out

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

