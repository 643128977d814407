"""Gradient reduction during backward: per-parameter hooks fill buckets, full buckets are reduced async.

Each trainable parameter gets a post-accumulate-grad hook. When a micro-step reduces (every micro-step at
stage 2, the boundary micro-step at stages 0 and 1), the hook marks the parameter's pieces as filled (stage
2 first copies its gradient into the bucket and frees ``p.grad``); a bucket whose pieces are all filled is
reduced asynchronously while backward goes on. Buckets are launched in one fixed order on every rank, as
DDP does, so collectives always match across ranks even when hooks fire in a different order.
"""
from __future__ import annotations


import torch

from zero_offload.comm import DistContext
from zero_offload.flat import FlatParams
from zero_offload.offload.copies import DONE, CopyHandle
from zero_offload.zero.averaging import GradAveraging
from zero_offload.zero.buckets import GradBucket, plan_buckets
from zero_offload.zero.collectives import InFlight, PendingReduction, finish, reduce_bucket
from zero_offload.zero.grad_partition import GradPartition

__all__ = ["GradientReducer"]


class _BufferPool:
    """Bucket buffers reused once the copy that reads them has finished (its event), on every device.

    A released buffer keeps the handle of the last copy that reads it; it is handed out again only after
    that copy's event (`CopyHandle.wait_stream`: the compute stream waits for that copy alone on CUDA, the host
    blocks on the CPU) -- the event-ordered reuse of FSDP2's reduce-scatter buffers, instead of
    ``record_stream`` keeping every buffer alive. The pool grows only while one backward has more buckets
    filling and in flight at once than it holds; from the second backward on it never allocates.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.free: dict[int, list[tuple[torch.Tensor, CopyHandle]]] = {}
        self.allocated = 0                 # buffers made so far (`buffers` lists the idle ones)

    def acquire(self, numel: int) -> torch.Tensor:
        stack = self.free.get(numel)
        if stack:
            buf, handle = stack.pop(0)     # the oldest release: its copy is the likeliest to be done
            handle.wait_stream()
            return buf
        self.allocated += 1
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def buffers(self) -> list[torch.Tensor]:
        """The idle buffers the pool holds (all of them between backward passes)."""
        return [b for stack in self.free.values() for b, _ in stack]

    def release(self, buf: torch.Tensor, handle: CopyHandle = DONE) -> None:
        """Take ``buf`` back; ``handle``: the copy still reading it (`DONE`: none)."""
        self.free.setdefault(buf.numel(), []).append((buf, handle))


class GradientReducer:
    """Owns the gradient buckets of all param groups and drives their reduction.

    Args:
        flats: the flat parameter buffers, one per group.
        partitions: where reduced gradients go, one per group.
        flat_grads: stage 0/1 only: full flat gradient buffers whose views are the parameters' ``.grad``.
        max_in_flight: buckets reduced concurrently before the oldest is waited for (bounds bucket memory).
    """

    def __init__(self, ctx: DistContext, flats: list[FlatParams], partitions: list[GradPartition],
                 flat_grads: list[torch.Tensor] | None, stage: int, bucket_numel: int, overlap: bool,
                 max_in_flight: int = 2, averaging: GradAveraging | None = None,
                 comm_dtype: torch.dtype | None = None):
        self.ctx, self.flats, self.partitions = ctx, flats, partitions
        self.averaging = averaging or GradAveraging(ctx.world_size)
        self.flat_grads = flat_grads
        self.stage, self.overlap, self.max_in_flight = stage, overlap, max_in_flight
        self.comm_dtype = comm_dtype                       # communication_data_type (None: the training dtype)
        buckets = [b for g, f in enumerate(flats) for b in plan_buckets(f, g, bucket_numel, stage >= 1)]
        self.buckets = sorted(buckets, key=lambda b: b.order_key)
        self.pieces_of: dict[int, list[tuple[GradBucket, int]]] = {}
        for b in self.buckets:
            for i, piece in enumerate(b.pieces):
                self.pieces_of.setdefault(id(piece.param), []).append((b, i))
        self.pool = _BufferPool(flats[0].dtype, flats[0].device)
        self.reducing = False
        self.first_micro_step = True
        self.next_launch = 0
        self.in_flight: InFlight[GradBucket] = InFlight(max_in_flight, self._complete)
        # The reducer's state of each bucket this micro-step, kept here (buckets describe ranges only).
        self.buffer_of: dict[GradBucket, torch.Tensor] = {}
        self.reduction_of: dict[GradBucket, PendingReduction] = {}
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                      for f in flats for p in f.params]

    # -- micro-step life cycle -------------------------------------------------------------------------
    def begin_micro_step(self, reduce: bool, first_micro_step: bool) -> None:
        """Arm the hooks for one backward; ``reduce`` says whether this micro-step's buckets are reduced."""
        self.reducing, self.first_micro_step = reduce, first_micro_step
        self.next_launch = 0
        if self.flat_grads is not None:
            self._attach_grad_views()
        for b in self.buckets:
            b.reset()
        self.buffer_of.clear()
        self.reduction_of.clear()
        if reduce:
            self._launch_ready()   # buckets of padding alone are ready before any gradient arrives

    def end_micro_step(self) -> None:
        """After backward: treat parameters that got no gradient as zero, reduce the rest, wait for all."""
        if not self.reducing:
            return
        for b in self.buckets[self.next_launch:]:
            for i, done in enumerate(b.filled):
                if not done:
                    if self.stage == 2:
                        piece = b.pieces[i]
                        self._buffer(b)[piece.bucket_lo:piece.bucket_hi].zero_()
                    b.fill(i)
        self._launch_ready()
        self.in_flight.drain()
        self.reducing = False

    # -- hooks -----------------------------------------------------------------------------------------
    def _attach_grad_views(self) -> None:
        # Stage 0/1 gradients accumulate in place in the flat buffer; re-attach if the user reset .grad.
        for f, g in zip(self.flats, self.flat_grads):
            for p, s in zip(f.params, f.slots):
                if p.grad is None or p.grad.data_ptr() != g[s.offset:].data_ptr():
                    p.grad = g[s.offset:s.end].view(s.shape)

    @torch.no_grad()
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self.reducing:
            return
        newly_ready = False
        for bucket, i in self.pieces_of[id(param)]:
            if self.stage == 2:
                piece = bucket.pieces[i]
                self._buffer(bucket)[piece.bucket_lo:piece.bucket_hi].copy_(
                    param.grad.reshape(-1)[piece.param_lo:piece.param_hi])
            newly_ready |= bucket.fill(i)
        if self.stage == 2:
            param.grad = None   # its gradient now lives in buckets only: stage 2 keeps no full gradient
        if newly_ready:
            self._launch_ready()

    # -- buckets ---------------------------------------------------------------------------------------
    def _buffer(self, b: GradBucket) -> torch.Tensor:
        """The bucket's gradient storage: a view of the flat gradient (stage 0/1) or a pooled buffer."""
        buffer = self.buffer_of.get(b)
        if buffer is None:
            if self.flat_grads is not None:
                buffer = self.flat_grads[b.group][b.lo:b.hi]
            else:
                buffer = self.pool.acquire(b.numel)
                if b.pad_lo < b.numel:
                    buffer[b.pad_lo:].zero_()
            self.buffer_of[b] = buffer
        return buffer

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].ready:
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1

    def _launch(self, b: GradBucket) -> None:
        self.reduction_of[b] = reduce_bucket(self.ctx, self._buffer(b), self.averaging, self.comm_dtype, b.owner)
        self.in_flight.push(b)
        if not self.overlap:
            self.in_flight.drain()

    def _complete(self, b: GradBucket) -> None:
        reduced, buffer = finish(self.reduction_of.pop(b)), self.buffer_of.pop(b)
        reading = DONE
        if reduced is not None:
            if reduced is not buffer:
                buffer.copy_(reduced)
            reading = self.partitions[b.group].consume(b, buffer, self.first_micro_step)
        if self.flat_grads is None:
            self.pool.release(buffer, reading)
