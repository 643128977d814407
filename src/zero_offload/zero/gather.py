"""Collectives over this rank's partitions that every ZeRO stage needs at the step boundary."""
from __future__ import annotations

import torch

from zero_offload.comm import DistContext
from zero_offload.zero.grad_partition import GradPartition
from zero_offload.zero.layout import GroupLayout

__all__ = ["global_grad_sq_norm", "gather_masters"]


def global_grad_sq_norm(ctx: DistContext, partitions: list[GradPartition], partitioned: bool,
                        replaced: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Squared L2 norm of the whole (loss-scaled) gradient, a 0-dim fp32 CPU tensor: the sum of this rank's
    partitions, all-reduced when the ranks hold different partitions. Host pieces are added on the host, device
    pieces on the device; one device read brings the total to the host (the clip coefficient is needed there), and
    with several ranks the host sum goes up without a sync to join the one all-reduce.

    Raises:
        RuntimeError: a partition with copies still in flight (read before ``finalize_backward``).

    ``replaced``: {group: this rank's sum of squares of what stands in for that group's gradient}, counted instead
    of the group's partition (the Muon update under DeepSpeed's order: `PartitionedMuon.prepare_updates`).
    """
    replaced = replaced or {}
    pieces = [t for g, p in enumerate(partitions) if g not in replaced for t in p.sq_norm_pieces()]
    pieces += list(replaced.values())
    host = sum((t for t in pieces if t.device.type == "cpu"), torch.zeros((), dtype=torch.float32))
    on_device = [t for t in pieces if t.device.type != "cpu"]
    if partitioned and ctx.world_size > 1:
        total = host.to(ctx.device, non_blocking=True)
        for t in on_device:
            total = total + t.to(ctx.device)
        ctx.all_reduce(total, async_op=False)
        return total.cpu()
    return host + sum(on_device).cpu() if on_device else host


def gather_masters(ctx: DistContext, layouts: list[GroupLayout], masters: list[torch.Tensor],
                   partitions: int, stats: dict | None = None) -> dict[str, torch.Tensor]:
    """{name: fp32 CPU tensor} of every parameter, assembled from all ranks' master partitions (a collective when
    ``partitions`` > 1: every rank calls it and every rank gets the whole dict). Piece by piece: the owner of each
    piece puts it on the device, one broadcast brings it to every rank, and it goes to host memory before the next,
    so the device holds at most one piece (at most the largest parameter, in fp32), as DeepSpeed's
    ``_zero3_consolidated_16bit_state_dict`` gathers whole parameters. ``stats``, when given, receives
    ``peak_device_bytes``: the most bytes of device buffers this function held at once.
    """
    out, peak = {}, 0
    for layout, master in zip(layouts, masters):
        for p in layout.params:
            flat = torch.empty(p.numel, dtype=torch.float32)
            for c in p.pieces:
                src = master[c.part_offset:c.part_offset + c.length]
                dst = flat[c.param_offset:c.param_offset + c.length]
                if partitions == 1:
                    dst.copy_(src)
                    continue
                piece = (src.to(ctx.device, torch.float32, copy=True) if c.rank == ctx.rank
                         else torch.empty(c.length, dtype=torch.float32, device=ctx.device))
                peak = max(peak, piece.numel() * piece.element_size())
                ctx.broadcast_from(piece, c.rank)
                dst.copy_(piece)
                del piece
            out[p.name] = flat.view(p.shape)
    if stats is not None:
        stats["peak_device_bytes"] = peak
    return out
