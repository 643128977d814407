"""Stage-2 bucket buffers: a fixed pool allocated once, each buffer reused only after its last reader's event.

DeepSpeed's stage 2 fills two ``ipg_buffer``s in turn; FSDP2 orders the reuse of reduce-scatter outputs by events.
Here a fixed number of buffers of the largest bucket is handed out again only once the copy that last read one has
finished (`CopyHandle.wait_stream`); nothing is kept alive by ``record_stream``, so bucket memory is the pool's.
"""
from __future__ import annotations

import warnings
from collections import deque

import torch

from zero_offload.offload.handles import DONE, CopyHandle
from zero_offload.zero.collectives import MAX_IN_FLIGHT

__all__ = ["bucket_pool_size", "BucketPool"]


def bucket_pool_size(overlap: bool, buckets: int, max_in_flight: int = MAX_IN_FLIGHT) -> int:
    """Buffers a stage-2 reducer allocates: one bucket filling, one whose copy down may still read it, and with
    ``overlap_comm`` the ``max_in_flight`` reductions in flight; never more than ``buckets``. The memory model
    (`zero_offload.estimate.memory`) sizes the ``buckets`` line with this, so the two cannot drift apart."""
    return min(buckets, 2 + (max_in_flight if overlap else 0))


class BucketPool:
    """``count`` buffers of ``numel`` elements; `take` hands out a ``[:n]`` view of the oldest free one.

    Args:
        count: buffers allocated now (`bucket_pool_size`).
        numel: elements of each, the largest bucket's.
        dtype, device: of the buffers (the training dtype, the accelerator).
    """

    def __init__(self, count: int, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self.all: list[torch.Tensor] = []
        self.free: deque[tuple[torch.Tensor, CopyHandle]] = deque()
        self.grown = 0                     # buffers added beyond ``count`` (`grow`)
        for _ in range(count):
            self._add()

    def _add(self) -> None:
        buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.all.append(buf)
        self.free.append((buf, DONE))

    def take(self, numel: int) -> torch.Tensor | None:
        """A view of ``numel`` elements of the longest-released buffer, after its reader's event; None if
        every buffer is in use. Raises ValueError if ``numel`` exceeds the buffers' size."""
        if numel > self.numel:
            raise ValueError(f"bucket of {numel} elements exceeds the pool's {self.numel}-element buffers")
        if not self.free:
            return None
        buf, handle = self.free.popleft()
        handle.wait_stream()
        return buf[:numel]

    def grow(self) -> None:
        """Add one buffer for good (the same order recurs every step; the first growth warns): gradients arrive so
        far out of launch order (parameters registered in another order than backward produces them) that more
        buckets fill at once than the pool holds."""
        if self.grown == 0:
            warnings.warn(f"zero_offload: stage-2 gradients arrive out of bucket order; the bucket pool grows "
                          f"beyond {len(self.all)} buffers of {self.numel} elements", stacklevel=4)
        self.grown += 1
        self._add()

    def release(self, view: torch.Tensor, reading: CopyHandle = DONE) -> None:
        """Take back the buffer under ``view`` (from `take`); ``reading``: the copy still reading it."""
        buf = next((b for b in self.all if b.data_ptr() == view.data_ptr()), None)
        if buf is None:
            raise ValueError("released a tensor that is not one of the bucket pool's buffers")
        self.free.append((buf, reading))

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, in use or not (`memory_breakdown`'s ``buckets``)."""
        return list(self.all)
