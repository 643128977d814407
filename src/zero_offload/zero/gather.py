"""Collectives over this rank's partitions that every ZeRO stage needs at the step boundary."""
from __future__ import annotations

import torch
import torch.distributed as dist

from zero_offload.comm import DistContext
from zero_offload.zero.grad_partition import GradPartition
from zero_offload.zero.layout import GroupLayout, assemble

__all__ = ["global_grad_sq_norm", "gather_masters"]


def global_grad_sq_norm(ctx: DistContext, partitions: list[GradPartition], partitioned: bool) -> torch.Tensor:
    """Squared L2 norm of the whole (loss-scaled) gradient, a 0-dim fp32 CPU tensor: the sum of this
    rank's partitions, all-reduced when the ranks hold different partitions."""
    for p in partitions:
        p.ready()
    total = sum(p.sq_norm().to(ctx.device) for p in partitions)
    if partitioned:
        ctx.all_reduce(total, async_op=False)
    return total.cpu()


def gather_masters(ctx: DistContext, layouts: list[GroupLayout], masters: list[torch.Tensor],
                   partitions: int) -> dict[str, torch.Tensor]:
    """{name: fp32 CPU tensor} of every parameter, assembled from all ranks' master partitions
    (a collective when ``partitions`` > 1)."""
    out = {}
    for layout, master in zip(layouts, masters):
        local = master.detach().to(ctx.device, torch.float32).contiguous()
        if partitions > 1:
            gathered = torch.empty(partitions * local.numel(), dtype=torch.float32, device=ctx.device)
            dist.all_gather_into_tensor(gathered, local, group=ctx.group)
        else:
            gathered = local
        out.update({k: v.cpu().clone() for k, v in assemble(layout, gathered.view(partitions, -1)).items()})
    return out
