"""Process groups and the collectives ZeRO needs, with async handles.

`DistContext.create()` uses the default process group when one exists; otherwise it creates one from the
torchrun environment (NCCL on CUDA, gloo on CPU); with no such environment it is a single rank and no
collective is ever issued.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistContext", "DoneWork"]


class DoneWork:
    """The handle of a collective that had nothing to do (world size 1)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass
class DistContext:
    """This process's place among the data-parallel ranks and its compute device."""
    rank: int
    world_size: int
    device: torch.device
    group: object = None  # the data-parallel process group; None means the default group

    @classmethod
    def create(cls) -> "DistContext":
        """Join (or create) the data-parallel group; see the module docstring.

        Raises:
            RuntimeError: the torchrun environment is incomplete (names the missing variables).
        """
        cuda = torch.cuda.is_available()
        if not dist.is_initialized() and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {', '.join(missing)} "
                                   f"is not: launch with torchrun or set the process-group environment")
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if cuda else "gloo")
        if dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            # A gloo group computes on the CPU even where CUDA exists (gloo reduces CPU tensors only).
            cuda = cuda and dist.get_backend() != "gloo"
        else:
            rank, world = 0, 1
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return cls(rank, world, device)

    def broadcast_from_first(self, tensors) -> None:
        """Give every rank rank 0's values (the initial weights, as DeepSpeed's _broadcast_model)."""
        if self.distributed:
            for t in tensors:
                dist.broadcast(t, src=self._global(0), group=self.group)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def reduce(self, tensor: torch.Tensor, owner: int, async_op: bool = True):
        """Sum ``tensor`` over ranks into ``owner``'s copy (the bucketed reduce-scatter's per-owner part)."""
        if not self.distributed:
            return DoneWork()
        return dist.reduce(tensor, dst=self._global(owner), group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = True):
        """Sum ``tensor`` over ranks in place, on every rank."""
        if not self.distributed:
            return DoneWork()
        return dist.all_reduce(tensor, group=self.group, async_op=async_op)

    def all_gather_partitions(self, flat: torch.Tensor, partition_numel: int, bucket_numel: int) -> None:
        """Fill every rank's partition of ``flat`` from its owner, ``bucket_numel`` elements per collective.

        ``flat`` holds ``world_size`` contiguous partitions of ``partition_numel`` elements; this rank's
        partition is the input.
        """
        if not self.distributed:
            return
        parts = flat.view(self.world_size, partition_numel)
        if bucket_numel >= partition_numel:
            dist.all_gather_into_tensor(flat, parts[self.rank], group=self.group)
            return
        for lo in range(0, partition_numel, bucket_numel):
            hi = min(lo + bucket_numel, partition_numel)
            views = list(parts[:, lo:hi].unbind(0))
            dist.all_gather(views, views[self.rank].clone(), group=self.group)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)
