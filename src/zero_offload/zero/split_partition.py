"""``offload_optimizer.ratio``: part of each partition keeps its gradient and optimizer state on the device.

DeepSpeed's ZeRO-Offload++ "Twin-Flow" (``ratio``: the share offloaded; "Deep Optimizer States", arXiv 2410.21316,
and Megatron's HybridDeviceOptimizer split the same way; docs/offload.md). Each group's partition is cut once: its
first `device_numel` elements (the first layers and the embeddings, whose gradients backward produces last) stay on
the device. `SplitGradPartition` is the gradient side, `zero_offload.hoststep.split.SplitAdam` the optimizer side.
"""
from __future__ import annotations

import torch

from zero_offload.zero.flat import FlatParams
from zero_offload.offload.copies import DONE, CopyHandle, Copies
from zero_offload.zero.buckets import largest_bucket
from zero_offload.zero.grad_partition import GradPartition

__all__ = ["device_numel", "SplitGradPartition", "ALIGN", "split_for_flat", "split_partition"]

ALIGN = 64      # elements: the host part starts 256 bytes into an fp32 buffer, as the kernel's thread slices do


def device_numel(numel: int, ratio: float) -> int:
    """Elements of a partition of ``numel`` that stay on the device under ``ratio`` (the share offloaded): the
    first (1 - ratio) x numel, rounded down to `ALIGN`; 0 at ratio 1, ``numel`` at ratio 0."""
    if ratio >= 1.0:
        return 0
    if ratio <= 0.0:
        return numel
    return min(numel, int(numel * (1.0 - ratio)) // ALIGN * ALIGN)


class SplitGradPartition:
    """One group's gradient partition [lo, hi) cut at ``lo + cut``: elements [lo, lo + cut) reduced into
    ``device`` (a `GradPartition` on the device), [lo + cut, hi) into ``host`` (an offloaded one). The optimizer
    reads the two as separate sources (`SplitAdam`); everything else sees the face of one partition."""

    def __init__(self, device: GradPartition, host: GradPartition):
        self.device, self.host = device, host
        self.lo, self.hi = device.lo, host.hi
        self.cut = device.hi - device.lo
        self.in_place = False

    def consume(self, bucket, reduced: torch.Tensor, first_micro_step: bool) -> CopyHandle:
        return self.accumulate(bucket.lo - self.lo, reduced, first_micro_step)

    def accumulate(self, offset: int, reduced: torch.Tensor, first_micro_step: bool) -> CopyHandle:
        """`GradPartition.accumulate` on whichever parts [offset, offset + len(reduced)) falls in; the handle of
        the host part's copy down (`DONE` when only the device part was written)."""
        n, handle = reduced.numel(), DONE
        if offset < self.cut:
            self.device.accumulate(offset, reduced[:min(n, self.cut - offset)], first_micro_step)
        if offset + n > self.cut:
            skip = max(0, self.cut - offset)
            handle = self.host.accumulate(offset + skip - self.cut, reduced[skip:], first_micro_step)
        return handle

    def _both(self, name: str, *args) -> None:
        for part in (self.device, self.host):
            getattr(part, name)(*args)

    def begin_micro_step(self) -> None:
        self._both("begin_micro_step")

    def forget_norm(self) -> None:
        self._both("forget_norm")

    def finalize(self) -> None:
        self._both("finalize")

    def close(self) -> None:
        self._both("close")

    def report_final_ranges(self, sink) -> None:
        """``super_offload`` speculates the host part only (its ranges in the host part's offsets)."""
        self.host.report_final_ranges(sink)

    def sq_norm_pieces(self) -> list[torch.Tensor]:
        return self.device.sq_norm_pieces() + self.host.sq_norm_pieces()

    def read_by(self, handle: CopyHandle, tensor: torch.Tensor) -> None:
        self.host.read_by(handle, tensor)

    def take(self):
        raise RuntimeError("a split gradient partition (offload_optimizer.ratio < 1) is not handed over: the "
                           "delayed update does not combine with ratio")

    def state_tensors(self) -> list[torch.Tensor]:
        """The host part's buffers (memory accounting; the device part's are `device_state_tensors`)."""
        return self.host.state_tensors()

    def device_state_tensors(self) -> list[torch.Tensor]:
        return self.device.state_tensors()

    def staging_tensors(self) -> list[torch.Tensor]:
        return self.host.staging_tensors()


def split_partition(numel: int, ratio: float, dtype: torch.dtype, device: torch.device, stage: int,
                    accumulate_fp32: bool, copies: Copies, lo: int = 0, piece_numel: int | None = None,
                    piece_dtype: torch.dtype | None = None) -> SplitGradPartition:
    """The gradient partition of ``numel`` elements from ``lo`` cut at `device_numel`, its host part offloaded
    (``piece_numel``: the largest piece either part receives; see `GradPartition`)."""
    cut = device_numel(numel, ratio)
    on_device = GradPartition(cut, dtype, device, stage, False, accumulate_fp32, copies, None, lo,
                              piece_numel=piece_numel, piece_dtype=piece_dtype)
    on_host = GradPartition(numel - cut, dtype, device, stage, True, accumulate_fp32, copies, None, lo + cut,
                            piece_numel=piece_numel, piece_dtype=piece_dtype)
    return SplitGradPartition(on_device, on_host)


def split_for_flat(flat: FlatParams, rank: int, stage: int, accumulate_fp32: bool, copies: Copies,
                   bucket_numel: int, ratio: float) -> SplitGradPartition:
    """`GradPartition.for_flat`'s partition of a stage-2 flat buffer, split (its pieces: the flat's buckets)."""
    lo, hi = flat.partition_range(rank)
    return split_partition(hi - lo, ratio, flat.dtype, flat.device, stage, accumulate_fp32, copies, lo,
                           piece_numel=largest_bucket(hi - lo, bucket_numel))
