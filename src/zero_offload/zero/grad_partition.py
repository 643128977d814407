"""This rank's reduced gradients for one param group: its partition (stage 1/2) or everything (stage 0)."""
from __future__ import annotations

from collections import deque
from typing import Protocol

import torch
from torch.profiler import record_function

from zero_offload.flat import FlatParams
from zero_offload.offload.grad_staging import staging_shape
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
    copied into a slot of a small pinned staging pool and added into the partition only once its copy (and
    every earlier one) has landed -- checked without blocking as new buckets arrive, and waited for in `ready`.
    So no micro-step synchronises the host per bucket. The pool is allocated once, at construction when the
    partition accumulates (`staging_shape`: a few slots of at most 4 MiB, never more than the partition in
    fp32), and never grows: a bucket larger than a slot goes down in slot-sized pieces, and a slot is reused
    only after the add of its previous piece (blocking on that copy's event when every slot is in flight).
    DeepSpeed's offloaded stage 2 keeps pinned buffers of fixed size for the same hand-off.

    Offloaded, the partition also keeps the sum of squares of what each micro-step wrote, piece by piece as
    the buckets land (DeepSpeed's offload computes its norm on the device as buckets are reduced): a bucket
    copied over the partition is summed on the device before it goes down, one added on the host is summed
    right after its add. So `sq_norm_pieces` at the boundary are two scalars, not a read of the partition.

    Shape (numel,) where numel is ``partition_numel`` (stage >= 1) or ``padded_numel`` (stage 0).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, stage: int, offload: bool,
                 accumulate_fp32: bool, copies: Copies, in_place: torch.Tensor | None = None, lo: int = 0):
        self.lo, self.hi = lo, lo + numel
        self.stage, self.offload, self.copies = stage, offload, copies
        self.in_place = in_place is not None
        # (copy's handle, staging slot or None, offset in the partition, the staged piece's elements and dtype,
        # the micro-step it belongs to)
        self.pending: deque[tuple[CopyHandle, int | None, int, int, torch.dtype, int]] = deque()
        self.micro_step = 0                            # counts `begin_micro_step`s: a late piece is not this one's
        self.staging: list[torch.Tensor] = []          # uint8 slots, viewed as the dtype of what they carry
        self.staging_busy: list[bool] = []
        self.staging_next = 0
        self.staging_allocations = 0                   # slots ever allocated (a test holds it fixed)
        self.spare: torch.Tensor | None = None
        self.tracks_norm = offload and not self.in_place
        self.sq_device: torch.Tensor | None = None   # 0-dim fp32: buckets summed on the device, this micro-step
        self.sq_host: torch.Tensor | None = None     # 0-dim fp32: slices summed on the host after their add
        self.sq_covered = -1                         # elements summed this micro-step; -1: not tracked
        if self.in_place:
            self.buffer = in_place
        else:
            dtype = torch.float32 if (stage >= 2 and accumulate_fp32) else dtype
            self.buffer = (copies.host_empty(numel, dtype) if offload
                           else torch.empty(numel, dtype=dtype, device=device)).zero_()
            if offload and stage >= 2 and accumulate_fp32:
                self._allocate_staging()

    def _allocate_staging(self) -> None:
        slots, slot_bytes = staging_shape(self.hi - self.lo)
        self.staging = [self.copies.host_empty(slot_bytes, torch.uint8) for _ in range(slots)]
        self.staging_busy = [False] * slots
        self.staging_allocations += slots

    @classmethod
    def for_flat(cls, flat: FlatParams, rank: int, stage: int, flat_grad: torch.Tensor | None, offload: bool,
                 accumulate_fp32: bool, copies: Copies) -> "GradPartition":
        """The partition of one stage 0-2 flat buffer that ``rank`` steps."""
        lo, hi = flat.partition_range(rank) if stage >= 1 else (0, flat.padded_numel)
        view = flat_grad[lo:hi] if (stage < 2 and not offload) else None
        return cls(hi - lo, flat.dtype, flat.device, stage, offload, accumulate_fp32, copies, view, lo)

    def begin_micro_step(self) -> None:
        """A micro-step that reduces into this partition starts: its writes replace the norm's pieces."""
        self.sq_device = self.sq_host = None
        self.sq_covered = 0 if self.tracks_norm else -1
        self.micro_step += 1

    def forget_norm(self) -> None:
        """The partition was changed outside `accumulate` (set aside and added back): its norm reads it whole."""
        self.sq_covered = -1

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
            if self.sq_covered >= 0:
                values = reduced if reduced.dtype == dst.dtype else reduced.to(dst.dtype)   # as stored
                self.sq_device = _add_sq(self.sq_device, values)
                self.sq_covered += reduced.numel()
            handle = self.copies.to_host(dst, reduced)
            self.pending.append((handle, None, offset, reduced.numel(), reduced.dtype, self.micro_step))
        else:
            if not self.staging:
                self._allocate_staging()           # a second backward at one micro-step per step
            handle = DONE
            per_slot = self.staging[0].numel() // reduced.element_size()
            for lo in range(0, reduced.numel(), per_slot):
                piece = reduced[lo:lo + per_slot]
                i = self._free_slot()
                slot = self.staging[i][:piece.numel() * piece.element_size()].view(piece.dtype)
                handle = self.copies.to_host(slot, piece)
                self.staging_busy[i] = True
                self.pending.append((handle, i, offset + lo, piece.numel(), piece.dtype, self.micro_step))
        self._drain(block=False)
        return handle                                # one stream: the last copy down finishes last

    def _free_slot(self) -> int:
        """The next staging slot in turn, once the add of its previous piece is done (blocking if need be)."""
        i = self.staging_next
        self.staging_next = (i + 1) % len(self.staging)
        while self.staging_busy[i]:
            self._drain(block=True, one=True)
        return i

    def _drain(self, block: bool, one: bool = False) -> None:
        """Finish landed copies in order: adds of staged pieces into the partition, their slots freed (``one``:
        at most one copy)."""
        while self.pending:
            handle, slot, offset, numel, dtype, micro_step = self.pending[0]
            if not block and not handle.query():
                return
            handle.synchronize()
            self.pending.popleft()
            if slot is not None:
                staged = self.staging[slot][:numel * dtype.itemsize].view(dtype)
                dst = self.buffer[offset:offset + numel]
                dst.add_(staged)
                if self.sq_covered >= 0 and micro_step == self.micro_step:   # an earlier one's lands late
                    self.sq_host = _add_sq(self.sq_host, dst)
                    self.sq_covered += numel
                self.staging_busy[slot] = False
            if one:
                return

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
        self.sq_covered = -1       # the pieces summed belong to the buffer handed out
        return ReadyGrad(done)

    def sq_norm_pieces(self) -> list[torch.Tensor]:
        """Sums of squares whose total is the partition's: 0-dim fp32 tensors, each on the device it was summed
        on (a bucket summed on the device before it went down; slices summed on the host after their add), or
        one sum over the whole partition where the pieces do not cover it. The caller adds them where it needs
        the total, so no piece crosses between host and device on its own (one device read in all).

        Computed in chunks of NORM_CHUNK elements: on the CPU a 16-bit norm with an fp32 accumulator first
        converts its whole input, and a chunk's conversion stays in cache (29.9 ms -> 3.7 ms for 21M bf16
        elements on 2 cores).

        Raises:
            RuntimeError: as `ready` (copies into the partition still in flight).
        """
        buffer = self.ready()
        if self.sq_covered == buffer.numel():     # summed piece by piece as the buckets landed
            return [t for t in (self.sq_device, self.sq_host) if t is not None]
        return [_add_sq(None, buffer)]

    def state_tensors(self) -> list[torch.Tensor]:
        """The buffers this partition holds apart from the flat gradient and the staging (memory accounting)."""
        if self.in_place:
            return []
        return [self.buffer] + ([self.spare] if self.spare is not None else [])

    def staging_tensors(self) -> list[torch.Tensor]:
        """The pinned staging slots (uint8) later micro-steps' gradients come down through (memory accounting)."""
        return list(self.staging)


def _add_sq(total: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """``total`` (None: 0) plus the sum of squares of ``values`` in fp32, on ``values``' device; in chunks of
    NORM_CHUNK on the CPU (see `GradPartition.sq_norm_pieces`)."""
    chunks = values.split(NORM_CHUNK) if values.device.type == "cpu" and values.dtype != torch.float32 else (values,)
    for chunk in chunks:
        sq = torch.linalg.vector_norm(chunk, dtype=torch.float32).square()
        total = sq if total is None else total + sq
    return total if total is not None else torch.zeros((), dtype=torch.float32, device=values.device)
