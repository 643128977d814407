"""The memory model: bytes per rank on the device, in host memory and on NVMe, by kind, for a ZeRO config.

Every model-state figure is computed with the engine's own sizing functions -- `flat.padded_numel` /
`flat.partition_numel` for padding and partitions (what `FlatParams` and stage-3 units allocate),
`offload.copies.host_alloc_bytes` for host buffers (pinned-pool rounding), the bucket plan of
`zero.buckets` -- so a change to how the engine allocates changes the estimate with it. Tests hold the
estimate to `Engine.memory_breakdown()` (2 %) and to the process's anonymous RSS growth (10 %).

Activations are a formula, not a measurement (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", Sec. 4.1), stated in `zero_offload.estimate.activations.activation_formula`; for a
Llama-family Hugging Face decoder in `zero_offload.estimate.decoder_activations.decoder_formula` (measured from
autograd's saved tensors).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zero_offload.config import Config
from zero_offload.zero.flat import padded_numel, partition_numel
from zero_offload.hoststep.banks import speculated_numel
from zero_offload.hoststep.muon_owners import ASSEMBLED_FORMULA, WINDOW_FORMULA, assembled_bytes, window_bytes
from zero_offload.estimate.shape import ModelShape, model_shape
from zero_offload.offload.copies import host_alloc_bytes
from zero_offload.offload.grad_staging import STAGING_FORMULA, staging_shape
from zero_offload.hoststep.grad_stream import SLOTS
from zero_offload.offload.staging_ring import ring_shape
from zero_offload.precision import training_dtype
from zero_offload.estimate.activations import activation_bytes, activation_formula, add_model_activations
from zero_offload.estimate.decoder_activations import SequenceTiles
from zero_offload.estimate.nvme_files import add_nvme_files
from zero_offload.zero.bucket_pool import bucket_pool_size
from zero_offload.zero.collectives import MAX_IN_FLIGHT, scattered_dtype
from zero_offload.zero.buckets import bucket_spans, largest_bucket
from zero_offload.zero.split_partition import device_numel
from zero_offload.zero.zero_optimizer import communication_dtype

__all__ = ["ModelShape", "MemoryEstimate", "estimate_memory", "model_shape", "activation_bytes",
           "activation_formula", "MODEL_STATE_KINDS"]

# Kinds that `Engine.memory_breakdown()` also reports (measured from the tensors the engine holds).
MODEL_STATE_KINDS = ("params", "grads", "buckets", "grad_partition", "grad_staging", "master", "exp_avg",
                     "exp_avg_sq", "param_staging", "param_incoming", "frozen_params", "nvme_buffers", "param_pool",
                     "param_write_ring", "speculative_state", "device_grad_partition", "device_master",
                     "device_exp_avg", "device_exp_avg_sq")
# Lines of the estimate that the engine's breakdown counts as part of the gradient partition.
GRAD_PARTITION_PARTS = {"grad_spare": "grad_partition"}


# Host buffers the engine page-locks with ``pin_memory`` (`zero_offload.offload.pinned.host_empty`): what copies
# to and from the device read or write.
PAGE_LOCKED_KINDS = frozenset({"grad_partition", "grad_staging", "grad_spare", "params", "param_staging"})


@dataclass
class MemoryEstimate:
    """Bytes per rank, by kind, on each side. On a machine without an accelerator ``device`` is host memory
    too (``accelerator`` False): `need` then adds the two.

    Attributes:
        device, host, nvme: {kind: bytes}.
        formulas: {kind: how it was computed}, for the figures that are formulas rather than sizes.
        pinned: bytes of the host's that are page-locked buffers (``pin_memory``; with an accelerator).
        checkpoint_input_bytes: one checkpoint input's bytes where ``cpu_checkpointing`` moves them (else 0).
        block_activation_bytes: one block's saved bytes where ``cpu_layers`` could move them (a decoder not
            checkpointed; else 0).
    """
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    nvme: dict[str, int] = field(default_factory=dict)
    accelerator: bool = True
    formulas: dict[str, str] = field(default_factory=dict)
    pinned: int = 0
    checkpoint_input_bytes: int = 0
    block_activation_bytes: int = 0

    def add(self, side: str, kind: str, nbytes: int) -> None:
        where = getattr(self, side)
        where[kind] = where.get(kind, 0) + int(nbytes)

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def nvme_bytes(self) -> int:
        return sum(self.nvme.values())

    def model_states(self) -> dict[str, int]:
        """{kind: bytes} over all sides for the kinds `Engine.memory_breakdown()` reports (which counts the
        delayed update's spare partition and the gradient staging under ``grad_partition``)."""
        out = {}
        for side in (self.device, self.host, self.nvme):
            for k, v in side.items():
                k = GRAD_PARTITION_PARTS.get(k, k)
                if k in MODEL_STATE_KINDS:
                    out[k] = out.get(k, 0) + v
        return out

    def need(self) -> dict[str, int]:
        """{"device", "host", "nvme": bytes} this rank needs; without an accelerator all is "host"."""
        if self.accelerator:
            return {"device": self.device_bytes, "host": self.host_bytes, "nvme": self.nvme_bytes}
        return {"device": 0, "host": self.device_bytes + self.host_bytes, "nvme": self.nvme_bytes}


def _stage2_bucket_bytes(group_numels: list[list[int]], world_size: int, bucket_numel: int, overlap: bool,
                        d: int) -> int:
    """Bytes of the stage-2 bucket pool (`zero.bucket_pool`): `bucket_pool_size` buffers of the largest bucket,
    where a bucket never crosses a partition (`zero.buckets.bucket_spans`)."""
    sizes = []
    for numels in group_numels:
        part = partition_numel(numels, world_size)
        sizes += [hi - lo for _, lo, hi in bucket_spans([(r * part, (r + 1) * part) for r in range(world_size)],
                                                        bucket_numel)]
    return bucket_pool_size(overlap, len(sizes)) * max(sizes, default=0) * d


def estimate_memory(model, config: "Config | dict | str | None" = None, world_size: int = 1, *,
                    micro_batch: int | None = None, seq_len: int | None = None,
                    activation_checkpointing: bool | None = None, accelerator: bool | None = None,
                    generation: bool = False, tiles: SequenceTiles | None = None) -> MemoryEstimate:
    """Bytes one rank of ``world_size`` holds to train ``model`` under ``config``, by kind and side.

    Args:
        model: an ``nn.Module`` (meta is fine), a preset name (``"gpt2-10b"``), a `GPTConfig`, or a
            parameter count.
        config: a DeepSpeed-style config (dict, JSON path or `Config`); default: the seed's stage 2 with
            the optimizer offloaded, bf16.
        micro_batch, seq_len: size the activations (default: the config's micro-batch and a GPT's context).
            A Llama-family decoder (transformers' Llama, Qwen2, Mistral) needs ``seq_len``: without it its
            activations are not counted (its ``max_position_embeddings``, 131072 for Llama 3.1, is no training
            length) and ``formulas["activations"]`` says so. Skipped for a bare parameter count or other models.
        activation_checkpointing: override the model's own setting (a GPT's config, a transformers model's
            ``is_activation_checkpointing``) for the activation figure.
        accelerator: whether the compute device is an accelerator (default: ``torch.cuda.is_available()``).
            Pinned host buffers round up to a power of two only then.
        generation: the run calls ``generate`` inside training (TRL's GRPO, RLOO): at stage 3 every unit is
            gathered at once for it (`Engine.gathered_for_generation`); ``generation_params`` is what that takes
            beyond ``live_params``, counted as if held beside everything else (an upper bound).
        tiles: the sequence-tiled compute a decoder runs with (`decoder_activations.SequenceTiles`: the logits and
            loss in tiles, `TiledFusedLogitsLoss`; each MLP in tiles, `TiledMLP`); None: whole.

    Kinds: ``params`` (16-bit flat buffers, or this rank's stage-3 shards), ``grads`` (full gradients,
    stages 0/1), ``buckets`` (stage-2 bucket buffers), ``grad_partition``, ``grad_staging`` (the pinned pool
    later micro-steps' gradients come down through: `zero_offload.offload.grad_staging`), ``master``,
    ``exp_avg``, ``exp_avg_sq``, ``param_staging`` (host copies of updated parameters), ``grad_spare`` (the
    delayed parameter update's second gradient partition), ``param_incoming`` (its device buffers the background
    step lands updated parameters in), ``frozen_params`` (parameters with
    ``requires_grad=False``: whole below stage 3, this rank's shards at stage 3), ``live_params`` (stage 3: gathered
    units, persistent ones and the prefetch / live-parameter budget), ``reduce_buffers`` (stage 3: unit
    gradients being reduce-scattered), ``generation_params`` (with ``generation``), ``pinned_rounding``,
    ``activations``.

    Raises:
        ConfigError: an invalid config (the message names the key).
        ValueError / TypeError: see `model_shape`; ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cfg = Config.load(config if config is not None else default_plan_config())
    shape = model if isinstance(model, ModelShape) else model_shape(model, muon=cfg.optimizer is not None
                                                                     and cfg.optimizer.type == "Muon")
    zc = cfg.zero_optimization
    sp = cfg.sequence_parallel_size       # Ulysses: each rank holds seq_len / sp positions
    accelerator = torch.cuda.is_available() if accelerator is None else accelerator
    dtype = training_dtype(cfg)
    d = torch.empty((), dtype=dtype).element_size()
    try:
        gas = cfg.batch_sizes(world_size // sp).gradient_accumulation_steps
        micro = cfg.batch_sizes(world_size // sp).micro_batch_per_gpu
    except Exception:                       # batch keys that do not divide: the engine reports it itself
        gas, micro = cfg.gradient_accumulation_steps or 1, cfg.train_micro_batch_size_per_gpu or 1
    # bf16.bf16_master_weights_and_grads: bf16 masters, and gradient partitions that accumulate in bf16
    bf16_masters = cfg.bf16.bf16_master_weights_and_grads
    master_dtype = cfg.bf16.master_dtype
    fp32_sum = gas > 1 and not bf16_masters
    grad_dtype_bytes = 4 if fp32_sum else d   # stage 2/3 partitions accumulate in fp32 under accumulation
    est = MemoryEstimate(accelerator=accelerator)
    offload_opt = zc.offload_optimizer.device in ("cpu", "nvme")
    offload_param = zc.stage == 3 and zc.offload_param.device in ("cpu", "nvme")
    # NVMe: master weights and moments (and parameter shards) live in files, sized with the NVMe layer's own
    # arithmetic in `zero_offload.estimate.nvme_files`; the host keeps gradients, the I/O pools and staging.
    state_nvme = zc.offload_optimizer.device == "nvme"
    param_nvme = offload_param and zc.offload_param.device == "nvme"
    # bf16.bf16_optimizer_states: the host kernel keeps both moments in bf16 (`BF16Config.state_dtype`).
    moment_bytes = 2 if cfg.bf16.bf16_optimizer_states and (offload_opt or not accelerator) else 4
    pin = zc.offload_optimizer.pin_memory or (zc.stage == 3 and zc.offload_param.pin_memory)
    speculative = zc.offload_optimizer.super_offload
    # offload_optimizer.ratio < 1: each partition's first `device_numel` elements stay on the device
    ratio = zc.offload_optimizer.ratio if offload_opt and not offload_param else 1.0
    # offload_optimizer.gradients_on_device: the partition stays on the device; the host step pulls it down
    streamed = offload_opt and zc.offload_optimizer.gradients_on_device
    rounding = 0

    def host(kind: str, numel: int, dtype_: torch.dtype, pinned: bool | None = None) -> None:
        nonlocal rounding
        nbytes = numel * torch.empty((), dtype=dtype_).element_size()
        if (state_nvme and kind == "master") or (param_nvme and kind == "params"):
            return                                 # in swap files: `zero_offload.estimate.nvme_files`
        est.add("host", kind, nbytes)
        locked = pin if pinned is None else pinned
        rounding += host_alloc_bytes(numel, dtype_, locked, accelerator) - nbytes
        # What the engine page-locks: buffers copies read or write (fp32 masters are copied up in fp32 training).
        copied_up = kind in ("master", "speculative_state") and (d == 4 or bf16_masters)
        if locked and accelerator and (kind in PAGE_LOCKED_KINDS or copied_up):
            est.pinned += nbytes

    def moments(numel: int, on_host: bool, g: int = -1) -> None:
        # Both Adam moments of a partition: on the device, or where the host step keeps them (memory or NVMe).
        # A Muon group keeps one fp32 momentum, counted as exp_avg.
        if on_host and state_nvme:
            return                                 # in swap files: `zero_offload.estimate.nvme_files`
        side = "host" if on_host else "device"
        muon = g in shape.muon_groups
        est.add(side, "exp_avg", numel * (4 if muon else moment_bytes))
        est.add(side, "exp_avg_sq", 0 if muon else numel * moment_bytes)

    def grad_staging(piece_numel: int, piece_bytes: int) -> None:
        # Accumulated gradients come down whole through two pinned slots of the largest piece (`GradPartition`).
        slots, slot_bytes = staging_shape(piece_numel, piece_bytes)
        host("grad_staging", slots * slot_bytes, torch.uint8)
        est.formulas["grad_staging"] = STAGING_FORMULA

    def gradient_partition(numel: int, dtype_: torch.dtype, staging_piece: int, piece_bytes: int) -> None:
        # An offloaded step's gradient partition: in host memory, with the staging its pieces come down through
        # under accumulation; or kept on the device, pulled down by the host step through a few pinned chunks
        # (`zero_offload.hoststep.grad_stream`; at stage 1 a view of the full gradient, nothing more).
        if not streamed:
            host("grad_partition", numel, dtype_)
            if staging_piece:
                grad_staging(staging_piece, piece_bytes)
            return
        if zc.stage >= 2:
            est.add("device", "grad_partition", numel * dtype_.itemsize)

    def device_part(cut: int) -> None:
        # The part of a split partition the device keeps: its gradient, fp32 master (unless fp32 training, where
        # the parameters are their own masters) and torch's fp32 moments.
        if cut:
            est.add("device", "device_grad_partition", cut * grad_dtype_bytes)
            if d < 4 and not bf16_masters:
                est.add("device", "device_master", cut * 4)
            est.add("device", "device_exp_avg", cut * 4)
            est.add("device", "device_exp_avg_sq", cut * 4)

    grad_dtype = torch.float32 if grad_dtype_bytes == 4 else dtype
    groups = shape.group_numels()
    if zc.stage < 3:
        parts = [partition_numel(n, world_size) if zc.stage >= 1 else padded_numel(sum(n), world_size)
                 for n in groups]
        for n in groups:
            est.add("device", "params", padded_numel(sum(n), world_size) * d)
            if zc.stage < 2:
                est.add("device", "grads", padded_numel(sum(n), world_size) * d)
        if shape.frozen:
            est.add("device", "frozen_params", sum(sum(n) for _, _, n in shape.frozen) * d)
        if zc.stage == 2:
            est.add("device", "buckets", _stage2_bucket_bytes(groups, world_size, zc.reduce_bucket_size,
                                                              bool(zc.overlap_comm), d))
            est.formulas["buckets"] = ("largest bucket x (2 + 2 in flight with overlap_comm, at most the bucket "
                                       "count) x d")
        for g, p in enumerate(parts):
            if offload_opt:
                cut = device_numel(p, ratio)
                device_part(cut)
                pieces = zc.stage == 2 and gas > 1       # pieces: this rank's buckets
                gradient_partition(p - cut, grad_dtype if zc.stage == 2 else dtype,
                                   pieces and min(largest_bucket(p, zc.reduce_bucket_size), p - cut), d)
                host("master", p - cut, master_dtype)
                moments(p - cut, on_host=True, g=g)
            else:
                if zc.stage == 2:
                    est.add("device", "grad_partition", p * grad_dtype_bytes)
                if d < 4 and not bf16_masters:            # bf16 masters in place: the parameters themselves
                    est.add("device", "master", p * 4)
                moments(p, on_host=False, g=g)
    else:
        host_step = offload_opt or offload_param
        parts, shards = [], []
        for g in range(len(groups)):
            parts.append(sum(partition_numel(n, world_size) for _, gi, n in shape.units if gi == g))
            shards.append(max((partition_numel(n, world_size) for _, gi, n in shape.units if gi == g), default=0))
        # Stage-3 pieces are reduce-scattered unit shards.
        shard_bytes = scattered_dtype(world_size, communication_dtype(cfg), dtype).itemsize
        if shape.frozen:
            frozen = sum(partition_numel(n, world_size) for _, _, n in shape.frozen) * d
            est.add("host" if offload_param else "device", "frozen_params", frozen)
        everything = shape.units + shape.frozen        # frozen units are gathered for compute too
        unit_bytes = sorted((padded_numel(sum(n), world_size) * d for _, _, n in everything), reverse=True)
        persistent = sum(padded_numel(sum(n), world_size) * d for _, _, n in everything
                         if sum(n) <= zc.stage3_param_persistence_threshold)
        budget = min(zc.stage3_max_live_parameters, zc.stage3_prefetch_bucket_size) * d
        est.add("device", "live_params", persistent + min(sum(unit_bytes), unit_bytes[0] + budget))
        est.formulas["live_params"] = ("persistent units + largest unit + min(stage3_max_live_parameters, "
                                       "stage3_prefetch_bucket_size) x d, at most the whole model")
        if generation:
            est.add("device", "generation_params", max(0, sum(unit_bytes) - est.device["live_params"]))
        reduced = sorted((padded_numel(sum(n), world_size) * d for _, _, n in shape.units), reverse=True)
        est.add("device", "reduce_buffers", sum(reduced[:MAX_IN_FLIGHT + 1]))   # frozen units reduce nothing
        for g, (p, shard) in enumerate(zip(parts, shards)):
            if offload_param:
                host("params", p, dtype)
            else:
                est.add("device", "params", p * d)
            if host_step:
                cut = device_numel(p, ratio)
                device_part(cut)
                gradient_partition(p - cut, grad_dtype, gas > 1 and min(shard, p - cut), shard_bytes)
                # Shards in memory of the masters' dtype are their masters (not under super_offload, whose banks
                # swap, nor the delayed update, whose step writes them at publish only)
                own = offload_param and not param_nvme and (d == 4 or bf16_masters)
                if not own or speculative or (bf16_masters and zc.offload_optimizer.delayed_param_update):
                    host("master", p - cut, master_dtype)
                moments(p - cut, on_host=True, g=g)
            else:
                est.add("device", "grad_partition", p * grad_dtype_bytes)
                if d < 4 and not bf16_masters:
                    est.add("device", "master", p * 4)
                moments(p, on_host=False, g=g)
    grads_on_host = offload_opt or offload_param
    parts = [p - device_numel(p, ratio) for p in parts]       # the host parts (all of each, at ratio 1)
    if streamed and parts:      # one set of slots for every group, a chunk of the largest partition each
        for _ in range(SLOTS):
            host("param_staging", min(zc.offload_optimizer.copy_chunk, max(parts)), grad_dtype if zc.stage >= 2
                 else dtype)
        est.formulas["param_staging"] = f"gradients on the device: {SLOTS} pinned chunks of min(copy_chunk, P)"
    if speculative and state_nvme:
        # super_offload over swap files steps each sub-group into a second bank of files (`zero_offload.nvme.
        # speculation`, counted in `estimate.nvme_files`); the parameters wait in a landing buffer like the parameters.
        if offload_param:
            for p in parts:
                host("param_staging", p, dtype)
        else:
            est.add("device", "param_incoming", sum(parts) * d)
        est.formulas["param_incoming"] = "super_offload: the partition again where the parameters are (P x d)"
    elif speculative:
        # super_offload steps into a second bank of masters and moments, or (a fraction f < 1) in place after an
        # undo copy of f of them (`zero_offload.hoststep.banks`); with device parameters each piece's 16-bit
        # parameters go through a pinned buffer into device landing buffers.
        fraction = zc.offload_optimizer.super_offload_fraction
        moment_dtype = torch.bfloat16 if moment_bytes == 2 else torch.float32
        pinned = None if fraction >= 1.0 else False       # an undo bank is never page-locked: only the host reads it
        for p in parts:
            for dtype_ in (master_dtype, moment_dtype, moment_dtype):
                host("speculative_state", speculated_numel(p, fraction), dtype_, pinned)
        est.formulas["speculative_state"] = ("super_offload: a second master and both moments, of the fraction "
                                             "speculated (f x P x (4 + 2 x moment))")
        if offload_opt and not offload_param:
            est.add("device", "param_incoming", sum(parts) * d)
            est.formulas["param_incoming"] = "super_offload: the partition again on the device (P x d)"
            if d < 4 and not bf16_masters:   # the speculated pieces' 16-bit outputs; below 1 the rest: the ring
                for p in parts:
                    host("param_staging", speculated_numel(p, fraction), dtype)
                if fraction < 1.0 and (grad_dtype if zc.stage >= 2 else dtype) == dtype:
                    slots, slot_numel = ring_shape(max(parts))
                    host("param_staging", slots * slot_numel, dtype)
    if grads_on_host and zc.offload_optimizer.delayed_param_update:
        # The delayed update hands this step's gradient partitions to the host step. Filled straight by the copies
        # down, a partition is lent and the next backward refills it behind the step (`GradPartition.take`);
        # under accumulation at stage >= 2 (fp32, through the staging worker) the next backward fills a second one.
        if zc.stage >= 2 and fp32_sum:
            for p in parts:
                host("grad_spare", p, grad_dtype)
            est.formulas["grad_spare"] = ("delayed update under accumulation: a second gradient partition "
                                          "(P x the partition's dtype)")
        if not offload_param:
            # Its step copies each finished chunk up into a device buffer the boundary copies over the parameters.
            est.add("device", "param_incoming", sum(parts) * d)
            est.formulas["param_incoming"] = "delayed update: the partition again on the device (P x d)"
    ring_used = offload_opt and not offload_param   # a 16-bit partition on the device is filled through it
    if ring_used and d < 4 and not state_nvme and parts and zc.offload_optimizer.delayed_param_update:
        # The delayed update's host step writes the 16-bit partition over the 16-bit gradient it reads, and publish
        # copies it up from there; an fp32 gradient partition (accumulation at stage >= 2) needs a pinned buffer.
        if (grad_dtype if zc.stage >= 2 else dtype) != dtype:
            for p in parts:
                host("param_staging", p, dtype)
        est.formulas["param_staging"] = ("delayed update: none where the gradient partition has the parameters' "
                                         "dtype (written over it), else the 16-bit partition (P x d)")
    elif ring_used and d < 4 and not state_nvme and parts and (grad_dtype if zc.stage >= 2 else dtype) != dtype:
        # Updated 16-bit parameters go up through a small pinned ring, not a partition-sized copy, where the
        # gradient partition is fp32 (accumulation); a 16-bit one takes them in place (`PartitionedAdam`).
        slots, slot_numel = ring_shape(max(parts))
        host("param_staging", slots * slot_numel, dtype)
        est.formulas["param_staging"] = " + ".join(f for f in (est.formulas.get("param_staging"),
                                                               "min(4, ceil(P / 2^21)) slots x min(2^21, P) x d") if f)
    if state_nvme or param_nvme:
        add_nvme_files(est, cfg, shape, parts, world_size, dtype, accelerator)
    if shape.muon_groups:
        est.add("device", "muon_assembled", assembled_bytes(sum(sum(groups[g]) for g in shape.muon_groups)))
        est.formulas["muon_assembled"] = ASSEMBLED_FORMULA
        # the step's updates and results, one round at a time, where the optimizer state lives
        est.add("host" if grads_on_host else "device", "muon_window",
                window_bytes(sum(parts[g] for g in shape.muon_groups)))
        est.formulas["muon_window"] = WINDOW_FORMULA
    if rounding:
        est.add("host", "pinned_rounding", rounding)
        est.formulas["pinned_rounding"] = ("each pinned host buffer rounded up to a power of two "
                                           "(torch's host allocator)")
    add_model_activations(est, shape, micro_batch or micro, seq_len, d, activation_checkpointing, sp, tiles,
                          cfg.activation_checkpointing)
    return est


def default_plan_config() -> dict:
    """The seed's config (DeepSpeed's ZeRO-Offload tutorial): stage 2, optimizer on the CPU, bf16."""
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "contiguous_gradients": True, "overlap_comm": True}}
