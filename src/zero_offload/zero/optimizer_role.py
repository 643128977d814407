"""`PartitionOptimizer`: the role a rank's partition optimizer plays for the ZeRO optimizers and checkpoints.

Two classes fill it: `zero_offload.zero.partitioned_adam.PartitionedAdam` (states in device or host memory)
and `zero_offload.nvme.adam.NvmeAdam` (states in NVMe swap files, streamed through a buffer pool).
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

__all__ = ["PartitionOptimizer"]


@runtime_checkable
class PartitionOptimizer(Protocol):
    """Adam over one 1-D partition per param group.

    Attributes:
        optimizer: a ``torch.optim.Optimizer`` whose ``param_groups`` carry the live hyper-parameters (the LR
            schedule writes ``lr`` there).
        masters: per group, the fp32 master partition (shape (partition numel,)); may be read lazily.
        outs: per group, a host staging tensor for updated 16-bit parameters, or None.
        on_host: whether the step runs on the host.
    """

    optimizer: torch.optim.Optimizer
    masters: Sequence[torch.Tensor]
    outs: list
    on_host: bool

    def step(self, grads: list[torch.Tensor], grad_scale: float) -> None:
        """Update every partition with ``grads`` x ``grad_scale``; the result lands in the parameters."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The host/device tensors held for optimizer state, by kind (for memory accounting)."""

    def swapped_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state kept in NVMe swap files, by kind (empty when all of it is in memory)."""

    def staging_tensors(self) -> list[torch.Tensor]:
        """Host buffers that only carry updated 16-bit parameters on their way out (for memory accounting)."""

    def write_master(self, g: int, offset: int, values: torch.Tensor) -> None:
        """Overwrite group ``g``'s fp32 master weights at ``offset`` with ``values`` (1-D), as
        ``gathered_parameters(modifier_rank=...)`` does."""

    def group_state(self, g: int) -> dict:
        """Group ``g``: fp32 CPU ``master``, ``exp_avg``, ``exp_avg_sq`` of shape (partition numel,), ``step``."""

    def load_group_state(self, g: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         step: int) -> None:
        """Replace group ``g``'s state and write its parameters from ``master``."""
