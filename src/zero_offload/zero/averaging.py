"""Where gradients are divided by the world size when they are averaged over ranks.

Mirrors DeepSpeed 0.19.8's ``prescale_gradients`` and ``gradient_predivide_factor``
(``stage_1_and_2.gradient_reduction_w_predivide``, ``stage3.__avg_scatter_grads``): the average is the same,
only where the division happens (and so fp16/bf16 range and rounding) changes.

- default: divide after the sum, or before it for an all-reduce or an fp16 buffer (to stay in range);
- ``prescale_gradients``: divide by the world size before the sum;
- ``gradient_predivide_factor`` f: divide by f before the sum and multiply by f / world size after.
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

    @classmethod
    def from_config(cls, config, world_size: int) -> "GradAveraging":
        return cls(world_size, config.prescale_gradients, config.gradient_predivide_factor)

    def before_sum(self, buf: torch.Tensor, divide_first: bool) -> None:
        """Scale ``buf`` in place before it is summed across ranks (``divide_first``: the default path would
        divide here: an all-reduce, or fp16)."""
        if self.world_size == 1:
            return
        if self.prescale:
            buf.div_(self.world_size)
        elif self.predivide != 1.0:
            buf.div_(self.predivide)
        elif divide_first:
            buf.div_(self.world_size)

    def after_sum(self, buf: torch.Tensor, divide_first: bool) -> None:
        """Scale the summed ``buf`` in place so that it holds the average over ranks."""
        if self.world_size == 1 or self.prescale:
            return
        if self.predivide != 1.0:
            if self.predivide != self.world_size:
                buf.mul_(self.predivide / self.world_size)
        elif not divide_first:
            buf.div_(self.world_size)
