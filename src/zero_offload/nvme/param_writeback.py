"""`WriteBackOptimizer`: a host optimizer with fp32 masters in memory over parameters kept on NVMe.

Stage 3 with ``offload_param.device = nvme`` and the optimizer states in host memory
(``offload_optimizer.device = cpu``): the wrapped `PartitionOptimizer` steps its fp32 master partitions
(which are its parameters: no 16-bit partition is held in memory), and after every step or state load the
16-bit parameters are rounded from the masters window by window and written to the parameter swap files
behind the step (`NvmeParamStore.write_behind`: `step` returns with the last writes in flight; the next
forward's reads wait for them -- DeepSpeed's fp16 param swap-out after the step, asynchronous there too).
"""
from __future__ import annotations

from typing import Iterable

import torch

from zero_offload.nvme.param_store import NvmeParamStore

__all__ = ["WriteBackOptimizer"]


class WriteBackOptimizer:
    """Wraps ``inner`` (built over fp32 masters read from ``store``) so that every change of the masters is
    written back to the parameter files. Same role as ``inner`` (`PartitionOptimizer` and the chunked state
    API); everything else is delegated."""

    def __init__(self, inner, store: NvmeParamStore):
        self.inner, self.store = inner, store

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @torch.no_grad()
    def write_back(self, groups: Iterable[int] | None = None) -> None:
        """Round group(s) ``groups`` (default all) of the masters to the training dtype into the files, behind:
        the writes are in flight when this returns (the masters may change at once)."""
        for g in range(len(self.inner.masters)) if groups is None else groups:
            self.store.write_behind(g, 0, self.inner.masters[g])

    def step(self, grads, grad_scale: float, lrs=None, publish: bool = True) -> None:
        """The inner optimizer's step (the `PartitionOptimizer` role, ``grads`` ready sources), then the
        updated parameters written back behind it (never deferred: the config refuses the delayed update with
        parameters on NVMe)."""
        self.inner.step(grads, grad_scale, lrs, publish)
        self.write_back()

    def load_state_chunks(self, g: int, step: int, chunks) -> None:
        self.inner.load_state_chunks(g, step, chunks)
        self.write_back([g])

    def load_group_state(self, g: int, master, exp_avg, exp_avg_sq, step: int) -> None:
        self.inner.load_group_state(g, master, exp_avg, exp_avg_sq, step)
        self.write_back([g])

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.write_back()

    def staging_tensors(self) -> list[torch.Tensor]:
        return self.inner.staging_tensors()

    def incoming_tensors(self) -> list[torch.Tensor]:
        return self.inner.incoming_tensors()

