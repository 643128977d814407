"""`ZeroOptimizer`: flat parameters, bucketed gradient reduction and the partitioned optimizer, together.

It knows the partitioning; the engine above it knows precision, clipping and the schedule (data flow: ARCHITECTURE.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.profiler import record_function

from zero_offload.comm import DistContext
from zero_offload.config import Config
from zero_offload.zero.flat import FlatParams
from zero_offload.offload.copies import make_copies
from zero_offload.zero.base import BuildStep, MemoryKind, ZeroOptimizerBase
from zero_offload.zero.grad_partition import GradPartition, accumulates_fp32
from zero_offload.zero.split_partition import split_for_flat
from zero_offload.zero.layout import GroupLayout, contiguous_layout
from zero_offload.zero.averaging import GradAveraging
from zero_offload.zero.reducer import GradientReducer

__all__ = ["ParamGroup", "ZeroOptimizer", "communication_dtype", "param_segments"]

_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def communication_dtype(config: Config) -> torch.dtype | None:
    """The dtype gradients are reduced in (``communication_data_type``); None: the training dtype."""
    return _COMM_DTYPES.get(config.communication_data_type)


@dataclass
class ParamGroup:
    """A param group as the engine hands it over: trainable parameters in model order, and hyper-params."""
    params: list[torch.nn.Parameter]
    names: list[str]
    indices: list[int]
    hparams: dict


def param_segments(flat: FlatParams, lo: int, hi: int) -> tuple[list[tuple[int, int, int]], int]:
    """Where each parameter of ``flat`` sits in the partition of elements [lo, hi): ((start, end, parameter
    index) relative to ``lo``, for every parameter with elements there; the number of parameters)."""
    pieces = [(max(s.offset, lo) - lo, min(s.end, hi) - lo, i) for i, s in enumerate(flat.slots)
              if s.offset < hi and s.end > lo]
    return pieces, len(flat.slots)


class ZeroOptimizer(ZeroOptimizerBase):
    """ZeRO stage 0, 1 or 2 over the given param groups, with the optimizer on the device or the host.

    Args:
        build_step: builds the partition optimizer over this rank's partitions
            (`zero_offload.hoststep.builder.build_partition_optimizer`).

    Raises:
        ValueError: a param group without parameters.
    """

    def __init__(self, ctx: DistContext, config: Config, groups: list[ParamGroup], gradient_accumulation: int,
                 build_step: BuildStep):
        zc = config.zero_optimization
        self.ctx, self.stage = ctx, zc.stage
        self.offload = zc.offload_optimizer.device in ("cpu", "nvme")
        self.allgather_bucket_numel = zc.allgather_bucket_size
        self.flats = [FlatParams(g.params, g.indices, g.names, ctx.world_size) for g in groups]
        ctx.broadcast_from_first(f.buffer for f in self.flats)   # every replica starts from rank 0's weights
        self.flat_grads = [torch.zeros_like(f.buffer) for f in self.flats] if self.stage < 2 else None
        self.copies = make_copies(ctx.device, zc.offload_optimizer.pin_memory)
        rank = ctx.rank if self.stage >= 1 else 0
        ratio = zc.offload_optimizer.ratio                       # < 1: part of each partition stays on the device
        fp32_sum = accumulates_fp32(config, gradient_accumulation)
        # gradients_on_device: the partition stays where it is reduced; the host step pulls it down
        self.grads_on_host = self.offload and not zc.offload_optimizer.gradients_on_device
        self.partitions = [split_for_flat(f, rank, self.stage, fp32_sum, self.copies, zc.reduce_bucket_size, ratio)
                           if ratio < 1.0 else
                           GradPartition.for_flat(f, rank, self.stage, self.flat_grads[i] if self.flat_grads else None,
                                                  self.grads_on_host, fp32_sum, self.copies,
                                                  bucket_numel=zc.reduce_bucket_size)
                           for i, f in enumerate(self.flats)]
        self.reducer = GradientReducer(ctx, self.flats, self.partitions, self.flat_grads, self.stage,
                                       zc.reduce_bucket_size, zc.overlap_comm,
                                       averaging=GradAveraging.from_config(config, ctx.world_size),
                                       comm_dtype=communication_dtype(config))
        parts = [f.buffer[p.lo:p.hi] for f, p in zip(self.flats, self.partitions)]
        segments = [param_segments(f, p.lo, p.hi) for f, p in zip(self.flats, self.partitions)]
        self.adam = build_step(config, parts, [g.hparams for g in groups], self.copies, ctx.rank,
                               offload=self.offload, segments=segments,
                               all_reduce=self._sum_over_ranks if self.stage >= 1 else None,
                               cuts=[p.cut for p in self.partitions] if ratio < 1.0 else None,
                               layouts=self.layout(), ctx=ctx)
        self.gathers = 0                   # all-gathers of updated partitions issued (running count)
        self.trainable_ids = {id(p) for f in self.flats for p in f.params}   # the model holds them all alive
        self._reduced = False              # stages 0/1: the full gradient was reduced since the last step
        self._set_aside: list[torch.Tensor] | None = None

    def _sum_over_ranks(self, t: torch.Tensor) -> None:
        """Sum a small tensor over the data-parallel ranks in place (Lamb's per-parameter norms), through the
        compute device (NCCL reduces device tensors only)."""
        on_device = t.to(self.ctx.device)
        self.ctx.all_reduce(on_device, async_op=False)
        t.copy_(on_device)

    def begin_forward(self) -> None:
        """Nothing to prepare before a forward: stages 0-2 keep every parameter whole."""

    def manages(self, p: torch.Tensor) -> bool:
        """True for a trainable parameter in this optimizer's flat buffers (a frozen one is the engine's)."""
        return id(p) in self.trainable_ids

    def begin_micro_step(self, boundary: bool, first_micro_step: bool) -> None:
        """Stage 2 reduces every micro-step (it keeps no full gradient); stages 0/1 at the boundary only, in place
        in the full gradient: before a second boundary backward the reduced partition is set aside and the full
        gradient cleared, and `end_micro_step` adds the new reduction to it (else it would be reduced twice)."""
        if self.stage < 2 and boundary and self._reduced:
            for p in self.partitions:
                p.finalize()
            self._set_aside = [p.buffer.clone() for p in self.partitions]
            for g in self.flat_grads:
                g.zero_()
        reduce = boundary or self.stage == 2
        if reduce:
            for p in self.partitions:
                p.begin_micro_step()
        self.reducer.begin_micro_step(reduce=reduce, first_micro_step=first_micro_step)
        self._reduced = self._reduced or (boundary and self.stage < 2)

    def end_micro_step(self) -> None:
        self.reducer.end_micro_step()
        if self._set_aside is not None:
            for p, kept in zip(self.partitions, self._set_aside):
                p.finalize()
                p.buffer.add_(kept)
                p.forget_norm()
            self._set_aside = None

    def step(self, grad_scale: float) -> None:
        """Update this rank's partitions with gradients x ``grad_scale`` (after `finalize_backward`), then
        all-gather (stage >= 1)."""
        self.adam.step(self.partitions, grad_scale)
        self.publish_readers()
        self._all_gather()

    def gather_count(self) -> int:
        """All-gathers of updated partitions issued so far (one per group and step, stages 1-2)."""
        return self.gathers

    def reduction_count(self) -> int:
        """Bucket reductions launched so far."""
        return self.reducer.in_flight.launched

    def _all_gather(self) -> None:
        if self.stage >= 1 and self.ctx.distributed:
            self.gathers += len(self.flats)
        if self.stage >= 1:
            with record_function("zero_offload.all_gather_params"):
                for f in self.flats:
                    self.ctx.all_gather_partitions(f.buffer, f.partition_numel, self.allgather_bucket_numel)

    # -- the delayed parameter update (see zero_offload.hoststep.delayed) --------------------------------
    def publish(self) -> None:
        """Copy the parameters of the last detached step up and all-gather them."""
        self.adam.publish()
        self.publish_readers()
        self._all_gather()

    def zero_grad(self) -> None:
        """Clear accumulated gradients after a step (stage 2 partitions are overwritten, not cleared)."""
        self._reduced, self._set_aside = False, None
        for g in self.flat_grads or []:
            g.zero_()

    def memory_kinds(self) -> dict[str, MemoryKind]:
        """The kinds of `memory_breakdown` at stages 0-2: ``params`` (16-bit flat buffers), ``grads`` (full flat
        gradients, stages 0/1), ``buckets`` (pooled stage-2 bucket buffers), then `partition_kinds`."""
        return {"params": ("device", [f.buffer for f in self.flats]),
                "grads": ("device", list(self.flat_grads or [])),
                "buckets": ("device", self.reducer.pool.buffers()),
                **self.partition_kinds()}

    @property
    def partitions_count(self) -> int:
        """How many distinct optimizer partitions exist (1 at stage 0, where every rank holds all)."""
        return self.ctx.world_size if self.stage >= 1 else 1

    def layout(self) -> list[GroupLayout]:
        """Where every parameter's elements sit in the ranks' partitions, one entry per group."""
        return [contiguous_layout(f, self.partitions_count) for f in self.flats]

    def after_load(self) -> None:
        """Bring every rank's full 16-bit parameters up to date after partitions were replaced."""
        if self.stage >= 1:
            for f in self.flats:
                self.ctx.all_gather_partitions(f.buffer, f.partition_numel, self.allgather_bucket_numel)
