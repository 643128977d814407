"""The loss of a whole sequence from its shards' losses, with exact gradients under the engine's gradient average.

Each rank of a sequence-parallel group computes the mean loss over its shard's non-ignored tokens. The sequence's
loss is their token-weighted mean (ALST, arXiv 2506.13996, section 3.1; transformers' ``deepspeed_sp_compute_loss``
computes the same value). Its gradient must count each token once over the group, and the engine divides the sum
over all ranks by `SequenceParallelGroups.gradient_divisor` (DeepSpeed 0.19.8's rule), so each rank backpropagates
its own share scaled by ``divisor / data-parallel size``: 1 at stages 0-2, the group size at stage 3.

(ALST's tutorial instead all-gathers the shard losses differentiably; torch's all-gather sums the gradients of
every rank's copy, so each rank's share comes out scaled by the group size, which is exact at stage 3 and the
group size times the gradient at stages 0-2 -- measured the same under DeepSpeed 0.19.8.)
"""
from __future__ import annotations

import torch

from zero_offload import comm
from zero_offload.sequence.groups import SequenceParallelGroups

__all__ = ["sequence_loss", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def sequence_loss(loss: torch.Tensor, shift_labels: torch.Tensor, groups: SequenceParallelGroups, stage: int,
                  ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The token-weighted mean of ``loss`` (this shard's mean over its tokens, a 0-d tensor) over the sequence-
    parallel group; ``shift_labels`` (this shard's labels, ``ignore_index`` where a position has no target) gives
    the weights. A shard with no target contributes nothing (its NaN mean is replaced by 0).

    Returns a 0-d float32 tensor, the same value on every rank of the group, whose gradient is exact under the
    engine's average at ZeRO ``stage``.
    """
    if groups.size == 1:
        return loss
    good = (shift_labels != ignore_index).sum().to(torch.float32)
    local = torch.where(good > 0, loss.float(), torch.zeros((), device=loss.device)) * good
    totals = torch.stack((local.detach(), good))
    comm.all_reduce_sum(totals, groups.group)
    share = groups.gradient_divisor(stage) / groups.data_parallel_size      # 1 at stages 0-2, the group size at 3
    return (share * local + (totals[0] - share * local.detach())) / totals[1].clamp(min=1)
