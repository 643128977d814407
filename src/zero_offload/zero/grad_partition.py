"""This rank's reduced gradients for one param group: its partition (stage 1/2) or everything (stage 0)."""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import torch
from torch.profiler import record_function

from zero_offload.zero.flat import FlatParams
from zero_offload.runtime.host_thread import HostThread
from zero_offload.offload import timeline
from zero_offload.offload.grad_staging import staging_shape
from zero_offload.offload.copies import DONE, CopyHandle, Copies
from zero_offload.offload.host_cores import available_cores
from zero_offload.optim.host_add import STAGED_ADD_THREADS, accumulate
from zero_offload.zero.buckets import GradBucket, largest_bucket
from zero_offload.offload.buffer_lease import BufferLease

__all__ = ["GradPartition", "ReadyGrad", "accumulates_fp32"]

NORM_CHUNK = 1 << 20


class ReadyGrad:
    """A gradient buffer handed over whole (the delayed parameter update's previous step), or any tensor
    already in place: ready as it is (the `zero_offload.hoststep.role.GradSource` role). With a ``lease`` the
    buffer is shared with the next backward, which waits for what the step has not released yet."""

    def __init__(self, buffer: torch.Tensor, lease: BufferLease | None = None):
        self.buffer, self.lease = buffer, lease

    def ready(self) -> torch.Tensor:
        return self.buffer

    def released(self, lo: int, hi: int, reader: CopyHandle) -> None:
        if self.lease is not None:
            self.lease.release(lo, hi, reader)

    def finish(self) -> None:
        """The step is over (finished or failed): the whole buffer is released."""
        if self.lease is not None:
            self.lease.release_all()


def accumulates_fp32(config, gradient_accumulation: int) -> bool:
    """Whether a stage 2/3 gradient partition accumulates micro-steps in fp32: under accumulation, unless the config
    keeps bf16 gradient partitions (``bf16.bf16_master_weights_and_grads``: DeepSpeed adds them in bf16)."""
    return gradient_accumulation > 1 and not config.bf16.bf16_master_weights_and_grads


class GradPartition:
    """Where reduced gradients of one group end up, ready for the optimizer step.

    - stage 0/1 on the device: a view of the full flat gradient (reduced in place, nothing to copy);
    - stage 1 offloaded: a host copy of the partition, filled bucket by bucket at the boundary;
    - stage 2/3: a partition-sized buffer (device, or host when offloaded) that each micro-step's reduced pieces
      are copied into (first micro-step) or added to (the rest): in the training dtype at one micro-step per step,
      in fp32 under accumulation so 16-bit rounding does not build up (as DeepSpeed's offload).

    Offloaded, every copy down is asynchronous with its own event. Under accumulation the pieces go down through
    two pinned staging slots (`offload.grad_staging.staging_shape`, allocated once) and a `host_thread.HostThread`
    converts or adds each into the fp32 partition once its copy landed, so the backward hook only issues copies
    (DeepSpeed's offloaded stage 2 accumulates on the CPU from fixed pinned buffers alike). The squares of what each
    micro-step wrote are summed as the pieces land, as DeepSpeed's offload computes its norm as buckets are reduced
    (ARCHITECTURE.md, "One step", 3).

    Shape (numel,) where numel is ``partition_numel`` (stage >= 1) or ``padded_numel`` (stage 0).

    Args:
        piece_numel: elements of the largest reduced piece this partition receives (stage 2: its largest
            bucket, `zero.buckets.largest_bucket`; stage 3: its largest unit shard); default: ``numel``.
        piece_dtype: the dtype pieces arrive in (communication dtype, else ``dtype``); default: ``dtype``.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, stage: int, offload: bool,
                 accumulate_fp32: bool, copies: Copies, in_place: torch.Tensor | None = None, lo: int = 0,
                 piece_numel: int | None = None, piece_dtype: torch.dtype | None = None):
        self.lo, self.hi = lo, lo + numel
        self.stage, self.offload, self.copies = stage, offload, copies
        self.in_place = in_place is not None
        self.piece_numel = numel if piece_numel is None else min(piece_numel, numel)
        self.piece_dtype = dtype if piece_dtype is None else piece_dtype
        # Copies straight into the partition still in flight: (handle, offset, elements).
        self.pending: deque[tuple[CopyHandle, int, int]] = deque()
        self.micro_step = 0                            # counts `begin_micro_step`s: a late piece is not this one's
        self.staging: list[torch.Tensor] = []          # uint8 slots, viewed as the dtype of what they carry
        self.slot_free: list[threading.Event] = []     # set by the worker once a slot's piece has been added
        self.staging_next = 0
        self.worker = HostThread(f"grad-staging-{lo}", device)
        self.add_threads = min(STAGED_ADD_THREADS, len(available_cores()))   # fixed: the adds run beside training
        self.spare: torch.Tensor | None = None
        # `take` lends the one buffer to the delayed update where the copies down fill it straight (no fp32 staging).
        self.shares_buffer = offload and in_place is None and not (stage >= 2 and accumulate_fp32)
        self.lease: BufferLease | None = None
        self.lease_reader: CopyHandle | None = None    # the lease's reader the copies down were last ordered after
        # Copies up that may still read ``buffer`` / ``spare`` (`read_by`): copies down into it wait for them.
        self.reader: CopyHandle | None = None
        self.spare_reader: CopyHandle | None = None
        self.tracks_norm = offload and not self.in_place
        # super_offload: where the boundary micro-step's final ranges are reported (`report_final_ranges`).
        self.final_sink = None
        self.final_micro_step = -1
        # The norm pieces are written by the training thread and the worker: under this lock.
        self.norm_lock = threading.Lock()
        self.sq_device: torch.Tensor | None = None   # 0-dim fp32: buckets summed on the device, this micro-step
        self.sq_host: torch.Tensor | None = None     # 0-dim fp32: staged pieces summed on the host after their add
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
        slots, slot_bytes = staging_shape(self.piece_numel, self.piece_dtype.itemsize)
        self.staging = [self.copies.host_empty(slot_bytes, torch.uint8) for _ in range(slots)]
        self.slot_free = [threading.Event() for _ in range(slots)]
        for free in self.slot_free:
            free.set()

    @classmethod
    def for_flat(cls, flat: FlatParams, rank: int, stage: int, flat_grad: torch.Tensor | None, offload: bool,
                 accumulate_fp32: bool, copies: Copies, bucket_numel: int | None = None) -> "GradPartition":
        """The partition of one stage 0-2 flat buffer that ``rank`` steps; its pieces are the flat's buckets of
        at most ``bucket_numel`` elements (default: one bucket per partition), in the flat's dtype."""
        lo, hi = flat.partition_range(rank) if stage >= 1 else (0, flat.padded_numel)
        view = flat_grad[lo:hi] if (stage < 2 and not offload) else None
        piece = largest_bucket(hi - lo, bucket_numel or hi - lo)
        return cls(hi - lo, flat.dtype, flat.device, stage, offload, accumulate_fp32, copies, view, lo,
                   piece_numel=piece)

    def report_final_ranges(self, sink) -> None:
        """The next micro-step is the boundary (``super_offload``): each range it writes is reported to ``sink``
        (a `zero_offload.hoststep.speculation.FinalRanges`) once final -- at its copy down, or after its staged add. A
        later micro-step before the step (another backward) invalidates what was reported."""
        self.final_sink, self.final_micro_step = sink, self.micro_step + 1

    def _final_sink(self):
        """The sink this micro-step's ranges are reported to, or None."""
        return self.final_sink if self.micro_step == self.final_micro_step else None

    def begin_micro_step(self) -> None:
        """A micro-step that reduces into this partition starts: its writes replace the norm's pieces."""
        if self._final_sink() is not None:       # the ranges reported change again
            self.final_sink.invalidate()
            self.final_sink = None
        with self.norm_lock:
            self.sq_device = self.sq_host = None
            self.sq_covered = 0 if self.tracks_norm else -1
            self.micro_step += 1

    def forget_norm(self) -> None:
        """The partition was changed outside `accumulate` (set aside and added back): its norm reads it whole."""
        with self.norm_lock:
            self.sq_covered = -1

    def consume(self, bucket: GradBucket, reduced: torch.Tensor, first_micro_step: bool) -> CopyHandle:
        """Take this rank's reduced ``bucket`` (already waited for) into the partition; returns the handle of
        the copy that still reads ``reduced`` (`DONE` when none does): ``reduced`` is not rewritten before it."""
        if self.in_place:
            return DONE
        return self.accumulate(bucket.lo - self.lo, reduced, first_micro_step)

    @record_function("zero_offload.grad_partition.accumulate")
    def accumulate(self, offset: int, reduced: torch.Tensor, first_micro_step: bool) -> CopyHandle:
        """Copy (first micro-step, or stage 1) or add ``reduced`` (1-D, the reduced dtype, on the device) into
        the partition at ``offset``; returns the handle of the copy down that reads ``reduced`` (`DONE` when
        nothing reads it any more). Offloaded, only issues copies (see the class docstring)."""
        dst = self.buffer[offset:offset + reduced.numel()]
        overwrite = first_micro_step or self.stage < 2
        if self.lease is not None:
            self._after_lease(offset)
        if self.reader is not None:                  # copies down wait for the copy up that reads the buffer
            self.copies.downloads_after(self.reader)
            self.reader = None
        if not self.offload:
            dst.copy_(reduced) if overwrite else dst.add_(reduced)
            return DONE
        # Straight in: one micro-step per step, or an fp32 piece on the first micro-step (nothing to convert).
        if overwrite and (not self.staging or reduced.dtype == dst.dtype):
            with self.norm_lock:
                if self.sq_covered >= 0:
                    values = reduced if reduced.dtype == dst.dtype else reduced.to(dst.dtype)   # as stored
                    self.sq_device = _add_sq(self.sq_device, values)
                    self.sq_covered += reduced.numel()
            handle = self.copies.to_host(dst, reduced)
            self.pending.append((handle, offset, reduced.numel()))
            sink = self._final_sink()
            if sink is not None:
                sink.landed(offset, dst, handle)
            while self.pending and self.pending[0][0].query():     # landed: forget them (never blocks)
                self.pending.popleft()
            return handle
        if not self.staging:
            self._allocate_staging()           # a second backward at one micro-step per step
        handle = DONE
        per_slot = self.staging[0].numel() // reduced.element_size()
        for lo in range(0, reduced.numel(), per_slot):
            piece = reduced[lo:lo + per_slot]
            i = self._free_slot()
            slot = self.staging[i][:piece.numel() * piece.element_size()].view(piece.dtype)
            handle = self.copies.to_host(slot, piece)
            self.worker.submit(self._host_side(handle, i, slot, offset + lo, dst[lo:lo + piece.numel()],
                                               overwrite))
        return handle                                # one stream: the last copy down finishes last

    def _after_lease(self, offset: int) -> None:
        """Before a copy down into [offset, ...) of a lent buffer: wait until the delayed step released it, and order
        the copies down after the copy up that last read it (the training thread's only wait on the host step)."""
        # Asked at every copy down, even once the whole buffer is released: the later copies go below ``offset``
        # (backward fills the partition from its end), into chunks whose copies up were queued later.
        reader = self.lease.wait(offset)
        if reader is not self.lease_reader:
            self.copies.downloads_after(reader)
            self.lease_reader = reader

    def _free_slot(self) -> int:
        """The next staging slot in turn, once the worker has added its previous piece (backpressure: the only
        wait of the training thread here, on the worker, never on a copy's event)."""
        i = self.staging_next
        self.staging_next = (i + 1) % len(self.staging)
        self.slot_free[i].wait()
        self.slot_free[i].clear()
        return i

    def _host_side(self, handle: CopyHandle, i: int, staged: torch.Tensor, at: int, dst: torch.Tensor,
                   overwrite: bool) -> Callable[[], None]:
        """The worker's share of one staged piece: wait for its copy down, convert it into (``overwrite``) or add
        it to ``dst`` (fp32, from partition element ``at``; bound now, as the delayed update may swap the buffer
        before it runs) summing the squares in the same pass, free slot ``i``, report the range final, then add
        the squares into this micro-step's norm piece."""
        micro_step, sink = self.micro_step, self._final_sink()

        def run() -> None:
            try:
                handle.synchronize()
                sq = accumulate(dst, staged, overwrite, self.add_threads)    # native, one pass: add and squares
                tl = timeline.current()
                if tl is not None:
                    tl.host_work("host_add", dst.numel())
            finally:
                self.slot_free[i].set()
            if sink is not None:
                sink.landed(at, dst, None)
            if self.tracks_norm:
                with self.norm_lock:
                    if self.sq_covered >= 0 and micro_step == self.micro_step:   # an earlier one's lands late
                        self.sq_host = sq if self.sq_host is None else self.sq_host + sq
                        self.sq_covered += dst.numel()
        return run

    def finalize(self) -> None:
        """Block until every gradient copied into the partition has landed and been added, so that the host may
        read it (from ``finalize_backward``, and before a second boundary backward sets the partition aside).

        Raises:
            HostThreadError: the staging worker failed (chained to its exception).
        """
        with record_function("zero_offload.grad_partition.finalize"):
            if self.pending:                   # one stream lands in order: one host wait, on the last copy
                self.pending[-1][0].synchronize()
                self.pending.clear()
            self.worker.join()
            tl = timeline.current()
            if tl is not None and self.staging:
                tl.joined(self.worker.name)

    def close(self) -> None:
        """Let the copies in flight land, run the staged adds queued and end the staging thread (from
        `Engine.close`). The partition stays readable; a later staged copy raises `HostThreadClosed`."""
        while self.pending:
            self.pending.popleft()[0].synchronize()
        self.worker.close()

    def ready(self) -> torch.Tensor:
        """The finished partition (the `zero_offload.hoststep.role.GradSource` role), without waiting.

        Raises:
            RuntimeError: copies into it are still in flight: `finalize` has not run since they were issued.
        """
        if self.pending or self.worker.busy:
            raise RuntimeError(f"a gradient partition was read with {len(self.pending) + self.worker.queued} copies "
                               "into it in flight: the ZeRO optimizer's finalize_backward() runs first at every "
                               "boundary")
        return self.buffer

    def take(self) -> ReadyGrad:
        """Hand the finished partition over whole (the delayed parameter update reads it while the next backward
        runs). Where the copies down fill the buffer straight, it is lent (`zero_offload.offload.buffer_lease`):
        the next backward writes each part once the step released it; else (fp32 accumulation through the staging
        worker) the next backward fills a second buffer, and the one handed out at the previous call is reused:
        the caller must be done with it (a copy up still reading it was named by `read_by`).

        Raises:
            RuntimeError: the partition is a view of the flat gradient (stage 0/1 without offload), or (as
                `ready`) copies into it are still in flight.
        """
        if self.in_place:
            raise RuntimeError("a stage 0/1 gradient partition on the device cannot be handed over")
        done = self.ready()
        if self.shares_buffer:              # one buffer, lent: the next backward waits for what is not released
            if self.lease is not None and not self.lease.released:
                raise RuntimeError("a gradient partition was handed over while the step before still held it")
            self.lease, self.lease_reader = BufferLease(done.numel()), None
            self.sq_covered = -1
            return ReadyGrad(done, self.lease)
        if self.spare is None:
            self.spare = (self.copies.host_empty(done.numel(), done.dtype) if self.offload
                          else torch.empty_like(done))
        self.buffer, self.spare = self.spare, done
        self.reader, self.spare_reader = self.spare_reader, self.reader
        self.sq_covered = -1       # the pieces summed belong to the buffer handed out
        return ReadyGrad(done)

    def released(self, lo: int, hi: int, reader: CopyHandle) -> None:
        """A synchronous step read the partition in place: nothing is lent (the `GradSource` role)."""

    def read_by(self, handle: CopyHandle, tensor: torch.Tensor) -> None:
        """A copy up reads ``tensor``, one of this partition's buffers (the delayed update publishes the
        parameters its host step wrote over the gradient): the next copies down into it start after that copy."""
        if tensor is self.buffer:
            self.reader = handle
        elif tensor is self.spare:
            self.spare_reader = handle

    def sq_norm_pieces(self) -> list[torch.Tensor]:
        """Sums of squares whose total is the partition's: 0-dim fp32 tensors, each on the device it was summed
        on (a bucket on the device before it went down; slices on the host after their add), or one sum over the
        whole partition where the pieces do not cover it (the caller adds them: `gather.global_grad_sq_norm`).

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

    def device_state_tensors(self) -> list[torch.Tensor]:
        """Buffers kept on the device beside an offloaded partition: none (`SplitGradPartition` has some)."""
        return []

    def staging_tensors(self) -> list[torch.Tensor]:
        """The pinned staging slots (uint8) later micro-steps' gradients come down through (memory accounting)."""
        return list(self.staging)


def _add_sq(total: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """``total`` (None: 0) plus the sum of squares of ``values`` in fp32, on ``values``' device. On the CPU a 16-bit
    input goes in chunks of NORM_CHUNK: the norm converts its whole input to fp32 first, and a chunk stays in cache."""
    chunks = values.split(NORM_CHUNK) if values.device.type == "cpu" and values.dtype != torch.float32 else (values,)
    for chunk in chunks:
        sq = torch.linalg.vector_norm(chunk, dtype=torch.float32).square()
        total = sq if total is None else total + sq
    return total if total is not None else torch.zeros((), dtype=torch.float32, device=values.device)
