"""Gradient reduction during backward: per-parameter hooks fill buckets, full buckets are reduced async.

When a micro-step reduces (every one at stage 2, the boundary's at stages 0 and 1), each parameter's
post-accumulate-grad hook marks its pieces filled (stage 2 first copies its gradient into the bucket and frees
``p.grad``). Buckets are launched in one fixed order on every rank, as DDP does, so collectives always match across
ranks even when hooks fire in a different order.
"""
from __future__ import annotations

import torch

from zero_offload.comm import DistContext
from zero_offload.zero.flat import FlatParams
from zero_offload.offload.copies import DONE
from zero_offload.zero.averaging import GradAveraging
from zero_offload.zero.bucket_pool import BucketPool, bucket_pool_size
from zero_offload.zero.buckets import GradBucket, plan_buckets
from zero_offload.zero.collectives import (MAX_IN_FLIGHT, InFlight, PendingReduction, completed, finish,
                                          reduce_bucket)
from zero_offload.zero.grad_partition import GradPartition

__all__ = ["GradientReducer"]


class GradientReducer:
    """Owns the gradient buckets of all param groups and drives their reduction.

    Args:
        flat_grads: stage 0/1 only: full flat gradient buffers whose views are the parameters' ``.grad``.
        max_in_flight: buckets reduced concurrently before the oldest is waited for (bounds bucket memory).
    """

    def __init__(self, ctx: DistContext, flats: list[FlatParams], partitions: list[GradPartition],
                 flat_grads: list[torch.Tensor] | None, stage: int, bucket_numel: int, overlap: bool,
                 max_in_flight: int = MAX_IN_FLIGHT, averaging: GradAveraging | None = None,
                 comm_dtype: torch.dtype | None = None):
        self.ctx, self.flats, self.partitions = ctx, flats, partitions
        self.averaging = averaging or GradAveraging(ctx.world_size)
        self.flat_grads = flat_grads
        self.stage, self.overlap = stage, overlap
        self.comm_dtype = comm_dtype                       # communication_data_type (None: the training dtype)
        buckets = [b for g, f in enumerate(flats) for b in plan_buckets(f, g, bucket_numel, stage >= 1)]
        self.buckets = sorted(buckets, key=lambda b: b.order_key)
        self.pieces_of: dict[int, list[tuple[GradBucket, int]]] = {}
        for b in self.buckets:
            for i, piece in enumerate(b.pieces):
                self.pieces_of.setdefault(id(piece.param), []).append((b, i))
        # Stage 2's buckets come from a pool allocated once (stages 0/1 reduce views of the flat gradient).
        count = bucket_pool_size(overlap, len(self.buckets), max_in_flight) if flat_grads is None else 0
        self.pool = BucketPool(count, max((b.numel for b in self.buckets), default=0), flats[0].dtype,
                               flats[0].device)
        self.reducing = False
        self.first_micro_step = True
        self.next_launch = 0
        self.in_flight: InFlight[GradBucket] = InFlight(max_in_flight, self._complete,
                                                        lambda b: completed(self.reduction_of[b]))
        # The reducer's state of each bucket this micro-step, kept here (buckets describe ranges only).
        self.buffer_of: dict[GradBucket, torch.Tensor] = {}
        self.reduction_of: dict[GradBucket, PendingReduction] = {}
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                      for f in flats for p in f.params]

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
            self._launch_ready()      # each bucket goes before the next takes a buffer: the pool suffices
        self.in_flight.drain()
        self.reducing = False

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
        for bucket, i in self.pieces_of[id(param)]:      # in launch order
            if self.stage == 2:
                piece = bucket.pieces[i]
                self._buffer(bucket)[piece.bucket_lo:piece.bucket_hi].copy_(
                    param.grad.reshape(-1)[piece.param_lo:piece.param_hi])
            if bucket.fill(i):
                self._launch_ready()   # before the next piece takes a buffer: a large parameter needs no more
        if self.stage == 2:
            param.grad = None   # its gradient now lives in buckets only: stage 2 keeps no full gradient

    def _buffer(self, b: GradBucket) -> torch.Tensor:
        """The bucket's gradient storage: a view of the flat gradient (stage 0/1) or a pooled buffer."""
        buffer = self.buffer_of.get(b)
        if buffer is None:
            if self.flat_grads is not None:
                buffer = self.flat_grads[b.group][b.lo:b.hi]
            else:
                buffer = self._pooled(b.numel)
                if b.pad_lo < b.numel:
                    buffer[b.pad_lo:].zero_()
            self.buffer_of[b] = buffer
        return buffer

    def _pooled(self, numel: int) -> torch.Tensor:
        """A pool buffer; when all are in use, finish the oldest reductions in flight (which hands theirs back)
        before growing the pool."""
        buffer = self.pool.take(numel)
        while buffer is None and len(self.in_flight):
            self.in_flight.finish_oldest()
            buffer = self.pool.take(numel)
        if buffer is None:
            self.pool.grow()
            buffer = self.pool.take(numel)
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
