"""The one gradient reduction path of every ZeRO stage: launch a reduce or reduce-scatter with its averaging, finish
it later, and bound how many are in flight (in the style of FSDP2's ``foreach_reduce``).

Stages 0-2 reduce buckets (`reduce_bucket`), stage 3 reduce-scatters each unit's flat gradient
(`reduce_scatter_grad`). Both cast to ``communication_data_type``, average where `GradAveraging` says (NCCL's
ReduceOp.AVG where it can) and hand back a `PendingReduction` that `finish` completes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

import torch
from torch.profiler import record_function

from zero_offload.comm import DistContext
from zero_offload.zero.averaging import GradAveraging

__all__ = ["PendingReduction", "reduce_bucket", "reduce_scatter_grad", "completed", "finish", "InFlight",
           "MAX_IN_FLIGHT", "scattered_dtype"]

# Reductions in flight before the oldest is finished: stage 2's buckets and stage 3's reduce-scatters (the
# memory model counts their buffers with it).
MAX_IN_FLIGHT = 2


@dataclass
class PendingReduction:
    """A reduction in flight."""
    out: torch.Tensor               # where the result lands, in the communication dtype (1-D)
    source: torch.Tensor            # the collective's input, kept alive until it finishes (may be ``out``)
    work: object                    # the collective's handle (None: nothing was launched)
    after: GradAveraging | None     # the averaging left to do on the result (None: the collective averaged, or none)
    divide_first: bool              # the averaging divided before the sum (`GradAveraging`'s argument)
    receives: bool                  # this rank receives the result (a reduce's owner, every rank otherwise)


def _prepare(ctx: DistContext, grad: torch.Tensor, averaging: GradAveraging, comm_dtype: torch.dtype | None,
             divide_first: bool) -> tuple[torch.Tensor, GradAveraging | None]:
    """Cast ``grad`` to the communication dtype and divide before the sum where that is the place; returns the
    buffer to reduce and the averaging still to do after the sum."""
    comm = grad if comm_dtype is None or grad.dtype == comm_dtype else grad.to(comm_dtype)
    native = averaging.native and ctx.native_average(comm.dtype)
    if native:
        return comm, None
    averaging.before_sum(comm, divide_first)
    return comm, averaging


def reduce_bucket(ctx: DistContext, grad: torch.Tensor, averaging: GradAveraging, comm_dtype: torch.dtype | None,
                  owner: int | None) -> PendingReduction:
    """Average ``grad`` (a bucket, 1-D) over ranks: all-reduced when ``owner`` is None (stage 0), else reduced
    into rank ``owner``'s copy (stages 1-2, DeepSpeed's bucketed reduce-scatter). An all-reduce, and fp16,
    divide before the sum; otherwise only the owner divides its result, in `finish`."""
    divide_first = owner is None or (comm_dtype or grad.dtype) == torch.float16
    comm, after = _prepare(ctx, grad, averaging, comm_dtype, divide_first)
    with record_function("zero_offload.reduce_bucket"):
        work = (ctx.all_reduce(comm, average=after is None) if owner is None
                else ctx.reduce(comm, owner, average=after is None))
    return PendingReduction(comm, comm, work, after, divide_first, owner is None or owner == ctx.rank)


def scattered_dtype(world_size: int, comm_dtype: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the shard `reduce_scatter_grad` hands back: ``comm_dtype`` across ranks (None: ``dtype``), the
    gradient's own ``dtype`` at one rank, where nothing is cast. The stage-3 gradient staging and the memory model
    size their pieces with it."""
    return (comm_dtype or dtype) if world_size > 1 else dtype


def reduce_scatter_grad(ctx: DistContext, flat: torch.Tensor, averaging: GradAveraging,
                        comm_dtype: torch.dtype | None) -> PendingReduction:
    """Average a stage-3 unit's flat gradient (world_size x shard elements) over ranks and keep this rank's
    shard of it. fp16 divides before the sum; otherwise the 1/N shard is divided after, not the whole
    gradient. One rank reduces nothing: its shard is the gradient itself, uncast."""
    if ctx.world_size == 1:
        return PendingReduction(flat, flat, None, None, False, True)
    divide_first = (comm_dtype or flat.dtype) == torch.float16
    comm, after = _prepare(ctx, flat, averaging, comm_dtype, divide_first)
    out = torch.empty(flat.numel() // ctx.world_size, dtype=comm.dtype, device=comm.device)
    with record_function("zero_offload.stage3.reduce_scatter"):
        work = ctx.reduce_scatter(out, comm, average=after is None)
    return PendingReduction(out, comm, work, after, divide_first, True)


def completed(p: PendingReduction) -> bool:
    """True when the reduction's collective has finished (never blocks; True when nothing was launched)."""
    return p.work is None or p.work.is_completed()


def finish(p: PendingReduction) -> torch.Tensor | None:
    """Wait for the reduction and finish its average; the result where this rank receives one, else None."""
    if p.work is not None:
        p.work.wait()
    if not p.receives:
        return None
    if p.after is not None:
        p.after.after_sum(p.out, p.divide_first)
    return p.out


T = TypeVar("T")


class InFlight(Generic[T]):
    """Reductions launched but not yet finished, oldest first, at most ``limit`` of them: pushing one more
    finishes the oldest (``on_finish``), which bounds the memory of buckets or gradients in flight. Oldest
    reductions already complete (``is_done``; at one rank every one is) are finished at once, so their copy down
    starts as soon as they are reduced, not ``limit`` buckets later (at one rank: after backward)."""

    def __init__(self, limit: int, on_finish: Callable[[T], None], is_done: Callable[[T], bool] | None = None):
        self.limit, self.on_finish, self.is_done = limit, on_finish, is_done
        self.items: deque[T] = deque()
        self.launched = 0            # running count of reductions pushed (`zero_offload.runtime.stats.StepStats`)

    def push(self, item: T) -> None:
        self.launched += 1
        self.items.append(item)
        while len(self.items) > self.limit or (self.items and self.is_done is not None
                                               and self.is_done(self.items[0])):
            self.on_finish(self.items.popleft())

    def finish_oldest(self) -> None:
        """Finish the oldest reduction in flight (its buffer is wanted now)."""
        self.on_finish(self.items.popleft())

    def drain(self) -> None:
        """Finish every reduction in flight, oldest first."""
        while self.items:
            self.on_finish(self.items.popleft())

    def __len__(self) -> int:
        return len(self.items)
