"""Where gradients are divided by the world size when they are averaged over ranks.

Mirrors DeepSpeed 0.19.8's ``prescale_gradients`` and ``gradient_predivide_factor``
(``stage_1_and_2.gradient_reduction_w_predivide``, ``stage3.__avg_scatter_grads``): the average is the same,
only where the division happens (and so fp16/bf16 range and rounding) changes.

- default: divide after the sum, or before it for an all-reduce or an fp16 buffer (to stay in range);
- ``prescale_gradients``: divide by the world size before the sum;
- ``gradient_predivide_factor`` f: divide by f before the sum and multiply by f / world size after.

Under sequence parallelism the divisor is not always the world size (`SequenceParallelGroups.gradient_divisor`):
DeepSpeed 0.19.8 divides by the data-parallel size (world / sequence-parallel size) at stages 0-2 and by the
world size at stage 3, and the losses written for it (ALST's, transformers') scale each rank's share to match.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GradAveraging"]


@dataclass(frozen=True)
class GradAveraging:
    world_size: int
    prescale: bool = False
    predivide: float = 1.0
    divisor: int | None = None      # what the sum is divided by; None: the world size

    @classmethod
    def from_config(cls, config, world_size: int) -> "GradAveraging":
        """The averaging ``config`` asks for over ``world_size`` ranks; with ``sequence_parallel_size`` P > 1 the
        divisor is DeepSpeed 0.19.8's: ``world_size / P`` at stages 0-2 (``stage_1_and_2``'s
        ``dp_world_size / sequence_parallel_size``), ``world_size`` at stage 3 (measured: its ZeRO-3 averages the
        sequence-parallel ranks too)."""
        sp, stage = config.sequence_parallel_size, config.zero_optimization.stage
        divisor = world_size // sp if sp > 1 and stage < 3 else None      # `SequenceParallelGroups.gradient_divisor`
        return cls(world_size, config.prescale_gradients, config.gradient_predivide_factor, divisor)

    @property
    def native(self) -> bool:
        """The collective's own average (NCCL's ReduceOp.AVG, a division by the world size) is the one wanted."""
        return not self.prescale and self.predivide == 1.0 and self.divisor is None

    def before_sum(self, buf: torch.Tensor, divide_first: bool) -> None:
        """Scale ``buf`` in place before it is summed across ranks (``divide_first``: the default path would
        divide here: an all-reduce, or fp16)."""
        if self.world_size == 1:
            return
        n = self.divisor or self.world_size
        if self.prescale:
            buf.div_(n)
        elif self.predivide != 1.0:
            buf.div_(self.predivide)
        elif divide_first and n != 1:
            buf.div_(n)

    def after_sum(self, buf: torch.Tensor, divide_first: bool) -> None:
        """Scale the summed ``buf`` in place so that it holds the average over ranks."""
        if self.world_size == 1 or self.prescale:
            return
        n = self.divisor or self.world_size
        if self.predivide != 1.0:
            if self.predivide != n:
                buf.mul_(self.predivide / n)
        elif not divide_first and n != 1:
            buf.div_(n)
