"""Gradient buckets: contiguous ranges of a group's flat gradient that are reduced as one collective.

A bucket never crosses a partition boundary, so its reduction has exactly one owner: the bucketed
reduce-scatter of ZeRO stage 1/2 is one ``reduce`` per bucket to the rank that owns its range (DeepSpeed's
stage-2 ``average_tensor`` does the same per partition). Stage 0 buckets are all-reduced.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zero_offload.zero.flat import FlatParams

__all__ = ["Piece", "GradBucket", "plan_buckets", "bucket_spans", "largest_bucket"]


@dataclass
class Piece:
    """The part [param_lo, param_hi) of a flattened parameter that lies in a bucket, at ``bucket_lo``."""
    param: torch.nn.Parameter
    param_lo: int
    param_hi: int
    bucket_lo: int

    @property
    def bucket_hi(self) -> int:
        return self.bucket_lo + self.param_hi - self.param_lo


@dataclass(eq=False)
class GradBucket:
    """Elements [lo, hi) of group ``group``'s flat gradient; ``owner`` is None for an all-reduce (stage 0). Per
    micro-step: `reset`, then its pieces filled as their gradients arrive (`fill`) until it is `ready`."""
    group: int
    lo: int
    hi: int
    owner: int | None
    pieces: list[Piece]
    pad_lo: int                   # bucket offset where zero padding starts (== numel when none)
    order_key: tuple[int, int]    # launch order: later-used parameters first, as backward produces them
    filled: list[bool] = field(default_factory=list)
    pending: int = 0

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def reset(self) -> None:
        self.filled = [False] * len(self.pieces)
        self.pending = len(self.pieces)

    def fill(self, index: int) -> bool:
        """Mark piece ``index`` as arrived; True when the bucket has just become ready."""
        if not self.filled[index]:
            self.filled[index] = True
            self.pending -= 1
            return self.pending == 0
        return False

    @property
    def ready(self) -> bool:
        return self.pending == 0


def bucket_spans(spans: list[tuple[int, int]], bucket_numel: int) -> list[tuple[int, int, int]]:
    """``(owner, lo, hi)`` of every bucket: each span (a partition) cut into buckets of at most
    ``bucket_numel`` elements from its end backwards, the order backward produces gradients (last layers
    first), so the first bucket fills as early as possible. The memory model sizes buckets with this too."""
    out = []
    for owner, (p_lo, p_hi) in enumerate(spans):
        hi = p_hi
        while hi > p_lo:
            lo = max(p_lo, hi - bucket_numel)
            out.append((owner, lo, hi))
            hi = lo
    return out


def largest_bucket(partition_numel: int, bucket_numel: int) -> int:
    """Elements of the largest bucket `bucket_spans` cuts a partition of ``partition_numel`` elements into (a
    bucket never crosses a partition boundary): the largest piece a stage-2 gradient partition receives. The
    engine and the memory model size the gradient staging with it (`offload.grad_staging.staging_shape`)."""
    return max((hi - lo for _, lo, hi in bucket_spans([(0, partition_numel)], bucket_numel)), default=0)


def plan_buckets(flat: FlatParams, group: int, bucket_numel: int, partitioned: bool) -> list[GradBucket]:
    """Split ``flat`` into buckets of at most ``bucket_numel`` elements, cut at partition boundaries
    (`bucket_spans`)."""
    spans = ([flat.partition_range(r) for r in range(flat.world_size)] if partitioned
             else [(0, flat.padded_numel)])
    buckets = []
    for owner, lo, hi in bucket_spans(spans, bucket_numel):
        inside = [(i, s) for i, s in enumerate(flat.slots) if s.offset < hi and s.end > lo]
        pieces = [Piece(flat.params[i], max(lo, s.offset) - s.offset, min(hi, s.end) - s.offset,
                        max(lo, s.offset) - lo) for i, s in inside]
        first_param = min((s.index for _, s in inside), default=1 << 62)
        bucket = GradBucket(group, lo, hi, owner if partitioned else None, pieces,
                            pad_lo=max(0, min(hi, flat.numel) - lo), order_key=(-first_param, -lo))
        bucket.reset()
        buckets.append(bucket)
    return buckets
