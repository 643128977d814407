"""This rank's reduced gradients for one param group: its partition (stage 1/2) or everything (stage 0)."""
from __future__ import annotations

import torch

from zero_offload.flat import FlatParams
from zero_offload.offload.copies import CopyEngine, host_empty
from zero_offload.zero.buckets import GradBucket

__all__ = ["GradPartition"]

NORM_CHUNK = 1 << 20


class GradPartition:
    """Where reduced gradients of one group end up, ready for the optimizer step.

    - stage 0/1 on the device: a view of the full flat gradient (reduced in place, nothing to copy);
    - stage 1 offloaded: a host copy of the partition, filled bucket by bucket at the boundary;
    - stage 2: a separate partition-sized buffer (device, or host when offloaded) that each micro-step's
      reduced buckets are copied into (first micro-step) or added to (the rest). Its dtype is the training
      dtype when there is one micro-step per step (fewest bytes for the host kernel) and fp32 under gradient
      accumulation, so accumulated 16-bit rounding does not build up (DeepSpeed's offload also accumulates
      in fp32).

    Shape (numel,) where numel is ``partition_numel`` (stage >= 1) or ``padded_numel`` (stage 0).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, stage: int, offload: bool,
                 accumulate_fp32: bool, pin: bool, copies: CopyEngine, in_place: torch.Tensor | None = None,
                 lo: int = 0):
        self.lo, self.hi = lo, lo + numel
        self.stage, self.offload, self.copies = stage, offload, copies
        self.in_place = in_place is not None
        if self.in_place:
            self.buffer = in_place
        else:
            dtype = torch.float32 if (stage >= 2 and accumulate_fp32) else dtype
            self.buffer = (host_empty(numel, dtype, pin) if offload
                           else torch.empty(numel, dtype=dtype, device=device)).zero_()

    @classmethod
    def for_flat(cls, flat: FlatParams, rank: int, stage: int, flat_grad: torch.Tensor | None, offload: bool,
                 accumulate_fp32: bool, pin: bool, copies: CopyEngine) -> "GradPartition":
        """The partition of one stage 0-2 flat buffer that ``rank`` steps."""
        lo, hi = flat.partition_range(rank) if stage >= 1 else (0, flat.padded_numel)
        view = flat_grad[lo:hi] if (stage < 2 and not offload) else None
        return cls(hi - lo, flat.dtype, flat.device, stage, offload, accumulate_fp32, pin, copies, view, lo)

    def consume(self, bucket: GradBucket, reduced: torch.Tensor, first_micro_step: bool) -> None:
        """Take this rank's reduced ``bucket`` (already waited for) into the partition."""
        if not self.in_place:
            self.accumulate(bucket.lo - self.lo, reduced, first_micro_step)

    def accumulate(self, offset: int, reduced: torch.Tensor, first_micro_step: bool) -> None:
        """Copy (first micro-step, or stage 1) or add ``reduced`` into the partition at ``offset``."""
        dst = self.buffer[offset:offset + reduced.numel()]
        if first_micro_step or self.stage < 2:
            if self.offload:
                self.copies.to_host(dst, reduced)
            else:
                dst.copy_(reduced)
        else:
            if self.offload:
                self.copies.synchronize()   # the first micro-step's async copies must land before adding
            dst.add_(reduced.to(dst.device, non_blocking=False))

    def ready(self) -> None:
        """Block until every gradient copied into the partition has landed (before the host reads it)."""
        if self.offload:
            self.copies.synchronize()

    def sq_norm(self) -> torch.Tensor:
        """Sum of squares of the partition's gradients, as a 0-dim fp32 tensor on the partition's device.

        Computed in chunks of NORM_CHUNK elements: on the CPU a 16-bit norm with an fp32 accumulator first
        converts its whole input, and a chunk's conversion stays in cache (29.9 ms -> 3.7 ms for 21M bf16
        elements on 2 cores).
        """
        if self.buffer.dtype == torch.float32 or self.buffer.is_cuda:
            return torch.linalg.vector_norm(self.buffer, dtype=torch.float32).square()
        total = torch.zeros((), dtype=torch.float32, device=self.buffer.device)
        for chunk in self.buffer.split(NORM_CHUNK):
            total += torch.linalg.vector_norm(chunk, dtype=torch.float32).square()
        return total
