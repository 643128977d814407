"""`PartitionStore`: where a stage-3 unit's 16-bit shard lives between gathers.

Two stores fill the role: `ResidentStore` (the shard is a view of the rank's partition in device memory, or
host memory with ``offload_param.device = cpu``: always readable) and
`zero_offload.nvme.param_store.NvmeParamStore` (``offload_param.device = nvme``: the shard lives in a swap
file and is read into a small pool of host buffers only around its gather, ZeRO-Infinity's parameter
offload, arXiv 2104.07857 Sec. 5). The unit life cycle asks the store, never the unit, where a shard is.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["PartitionStore", "ResidentStore"]


@runtime_checkable
class PartitionStore(Protocol):
    """Access to units' shards (``unit.shard_numel`` elements of the training dtype each)."""

    # True: shards are always in memory (`acquire` is free, a gather may stay in flight after it); False: `acquire`
    # hands out a pool buffer that `release` takes back.
    resident: bool

    def acquire(self, unit) -> torch.Tensor:
        """The unit's shard, readable now (waits for a read in flight): shape (unit.shard_numel,)."""

    def release(self, unit) -> None:
        """The gather no longer reads the tensor `acquire` returned."""

    def prefetch(self, unit) -> bool:
        """Start reading the unit's shard ahead of its gather; False when no buffer is free for it."""

    def close(self) -> None:
        """Finish the I/O in flight and end what the store started (NVMe: threads, swap files). Idempotent."""

    def write_shard(self, unit, values: torch.Tensor) -> None:
        """Replace the unit's shard with ``values`` (shape (unit.shard_numel,))."""


class ResidentStore:
    """Shards that are views of a partition held in memory (``unit.shard``, bound at materialisation)."""

    resident = True

    def acquire(self, unit) -> torch.Tensor:
        return unit.shard

    def release(self, unit) -> None:
        pass

    def prefetch(self, unit) -> bool:
        return True

    def close(self) -> None:
        """Nothing to end: the shards are plain tensors."""

    def write_shard(self, unit, values: torch.Tensor) -> None:
        unit.shard.copy_(values)
