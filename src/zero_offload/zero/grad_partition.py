"""This rank's reduced gradients for one param group: its partition (stage 1/2) or everything (stage 0)."""
from __future__ import annotations

from collections import deque
from typing import Protocol

import torch
from torch.profiler import record_function

from zero_offload.flat import FlatParams
from zero_offload.offload.copies import DONE, CopyHandle, Copies
from zero_offload.zero.buckets import GradBucket

__all__ = ["GradPartition", "GradSource", "ReadyGrad"]

NORM_CHUNK = 1 << 20


class GradSource(Protocol):
    """A gradient partition a partition optimizer reads in its step (`GradPartition`, or `ReadyGrad`).

    Its owner makes it ready once per boundary (the ZeRO optimizer's ``finalize_backward``, which the engine
    calls before the norm); reading it does not wait.
    """

    def ready(self) -> torch.Tensor:
        """The finished gradient partition, 1-D (training dtype, or fp32 under gradient accumulation).

        Raises:
            RuntimeError: copies into it are still in flight (read before ``finalize_backward``).
        """
        ...


class ReadyGrad:
    """A gradient buffer handed over whole (the delayed parameter update's previous step), or any tensor
    already in place: ready as it is (the `GradSource` role)."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    def ready(self) -> torch.Tensor:
        return self.buffer


class GradPartition:
    """Where reduced gradients of one group end up, ready for the optimizer step.

    - stage 0/1 on the device: a view of the full flat gradient (reduced in place, nothing to copy);
    - stage 1 offloaded: a host copy of the partition, filled bucket by bucket at the boundary;
    - stage 2/3: a separate partition-sized buffer (device, or host when offloaded) that each micro-step's
      reduced buckets are copied into (first micro-step) or added to (the rest). Its dtype is the training
      dtype when there is one micro-step per step (fewest bytes for the host kernel) and fp32 under gradient
      accumulation, so accumulated 16-bit rounding does not build up (DeepSpeed's offload also accumulates
      in fp32).

    Offloaded, every copy down is asynchronous and carries its own event: a later micro-step's bucket is
    copied into a small host staging buffer and added into the partition only once its copy (and every
    earlier one) has landed -- checked without blocking as new buckets arrive, and waited for in `ready`.
    So no micro-step synchronises the host per bucket.

    Shape (numel,) where numel is ``partition_numel`` (stage >= 1) or ``padded_numel`` (stage 0).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, stage: int, offload: bool,
                 accumulate_fp32: bool, copies: Copies, in_place: torch.Tensor | None = None, lo: int = 0):
        self.lo, self.hi = lo, lo + numel
        self.stage, self.offload, self.copies = stage, offload, copies
        self.in_place = in_place is not None
        self.pending: deque[tuple[CopyHandle, torch.Tensor | None, int]] = deque()
        self.staging: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.spare: torch.Tensor | None = None
        if self.in_place:
            self.buffer = in_place
        else:
            dtype = torch.float32 if (stage >= 2 and accumulate_fp32) else dtype
            self.buffer = (copies.host_empty(numel, dtype) if offload
                           else torch.empty(numel, dtype=dtype, device=device)).zero_()

    @classmethod
    def for_flat(cls, flat: FlatParams, rank: int, stage: int, flat_grad: torch.Tensor | None, offload: bool,
                 accumulate_fp32: bool, copies: Copies) -> "GradPartition":
        """The partition of one stage 0-2 flat buffer that ``rank`` steps."""
        lo, hi = flat.partition_range(rank) if stage >= 1 else (0, flat.padded_numel)
        view = flat_grad[lo:hi] if (stage < 2 and not offload) else None
        return cls(hi - lo, flat.dtype, flat.device, stage, offload, accumulate_fp32, copies, view, lo)

    def consume(self, bucket: GradBucket, reduced: torch.Tensor, first_micro_step: bool) -> CopyHandle:
        """Take this rank's reduced ``bucket`` (already waited for) into the partition; returns the handle of
        the copy that still reads ``reduced`` (`DONE` when none does): ``reduced`` is not rewritten before it."""
        if self.in_place:
            return DONE
        return self.accumulate(bucket.lo - self.lo, reduced, first_micro_step)

    @record_function("zero_offload.grad_partition.accumulate")
    def accumulate(self, offset: int, reduced: torch.Tensor, first_micro_step: bool) -> CopyHandle:
        """Copy (first micro-step, or stage 1) or add ``reduced`` into the partition at ``offset``; returns the
        handle of the copy down that reads ``reduced`` (`DONE` when nothing reads it any more)."""
        dst = self.buffer[offset:offset + reduced.numel()]
        overwrite = first_micro_step or self.stage < 2
        if not self.offload:
            dst.copy_(reduced) if overwrite else dst.add_(reduced)
            return DONE
        if overwrite:
            handle = self.copies.to_host(dst, reduced)
            self.pending.append((handle, None, offset))
        else:
            staging = self._staging(reduced.numel(), reduced.dtype)
            handle = self.copies.to_host(staging, reduced)
            self.pending.append((handle, staging, offset))
        self._drain(block=False)
        return handle

    def _staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self.staging.get((numel, dtype))
        return free.pop() if free else self.copies.host_empty(numel, dtype)

    def _drain(self, block: bool) -> None:
        """Finish landed copies in order: adds of staged buckets into the partition, staging reused."""
        while self.pending:
            handle, staging, offset = self.pending[0]
            if not block and not handle.query():
                return
            handle.synchronize()
            self.pending.popleft()
            if staging is not None:
                self.buffer[offset:offset + staging.numel()].add_(staging)
                self.staging.setdefault((staging.numel(), staging.dtype), []).append(staging)

    def finalize(self) -> None:
        """Block until every gradient copied into the partition has landed and been added (offloaded copies
        down), so that the host may read it: once per boundary, from the ZeRO optimizer's
        ``finalize_backward`` (and before a second boundary backward sets the partition aside)."""
        with record_function("zero_offload.grad_partition.finalize"):
            self._drain(block=True)

    def ready(self) -> torch.Tensor:
        """The finished partition (the `GradSource` role), without waiting.

        Raises:
            RuntimeError: copies into it are still in flight: `finalize` has not run since they were issued.
        """
        if self.pending:
            raise RuntimeError(f"a gradient partition was read with {len(self.pending)} copies into it in flight: "
                               "the ZeRO optimizer's finalize_backward() runs first at every boundary")
        return self.buffer

    def take(self) -> ReadyGrad:
        """Hand the finished partition over whole and continue into a second buffer (the delayed parameter
        update: the host step reads this step's gradients while the next backward fills the other buffer).
        The buffer handed out at the previous call is reused, so the caller must be done with it.

        Raises:
            RuntimeError: the partition is a view of the flat gradient (stage 0/1 without offload), or (as
                `ready`) copies into it are still in flight.
        """
        if self.in_place:
            raise RuntimeError("a stage 0/1 gradient partition on the device cannot be handed over")
        done = self.ready()
        if self.spare is None:
            self.spare = (self.copies.host_empty(done.numel(), done.dtype) if self.offload
                          else torch.empty_like(done))
        self.buffer = self.spare
        self.spare = done
        return ReadyGrad(done)

    def sq_norm(self) -> torch.Tensor:
        """Sum of squares of the partition's gradients, as a 0-dim fp32 tensor on the partition's device.

        Computed in chunks of NORM_CHUNK elements: on the CPU a 16-bit norm with an fp32 accumulator first
        converts its whole input, and a chunk's conversion stays in cache (29.9 ms -> 3.7 ms for 21M bf16
        elements on 2 cores).

        Raises:
            RuntimeError: as `ready` (copies into the partition still in flight).
        """
        buffer = self.ready()
        if buffer.dtype == torch.float32 or buffer.is_cuda:
            return torch.linalg.vector_norm(buffer, dtype=torch.float32).square()
        total = torch.zeros((), dtype=torch.float32, device=buffer.device)
        for chunk in buffer.split(NORM_CHUNK):
            total += torch.linalg.vector_norm(chunk, dtype=torch.float32).square()
        return total

    def state_tensors(self) -> list[torch.Tensor]:
        """The buffers this partition holds apart from the flat gradient (for memory accounting)."""
        if self.in_place:
            return []
        extra = [b for stack in self.staging.values() for b in stack]
        return [self.buffer] + ([self.spare] if self.spare is not None else []) + extra
