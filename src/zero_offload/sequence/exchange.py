"""Ulysses' all-to-all: trade a sequence shard of every head for the whole sequence of a shard of the heads.

Ulysses (DeepSpeed-Ulysses, arXiv 2309.14509, section 3) keeps attention exact under a sequence split across
``P`` ranks: before attention each rank sends head-chunk ``j`` of its sequence shard to rank ``j`` and receives
the whole sequence of its own head-chunk; after attention the inverse exchange restores the sequence split. Both
are one all-to-all of the same bytes, and each is the other's gradient.

Shapes (HF's attention layout): ``(batch, heads, seq_local, head_dim)`` <-> ``(batch, heads / P, seq, head_dim)``;
the sequence is in group-rank order (rank r holds positions ``[r * seq_local, (r + 1) * seq_local)``).
"""
from __future__ import annotations

import torch

from zero_offload import comm

__all__ = ["gather_sequence", "scatter_sequence"]


def _all_to_all(send: torch.Tensor, group, size: int) -> torch.Tensor:
    recv = torch.empty_like(send)
    split = [send.numel() // size] * size
    comm.all_to_all(recv.view(-1), send.view(-1), split, split, group)
    return recv


def _to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    batch, heads, local, dim = x.shape
    if heads % size:
        raise ValueError(f"Ulysses needs the head count ({heads}) divisible by the sequence-parallel size ({size})")
    send = x.reshape(batch, size, heads // size, local, dim).transpose(0, 1).contiguous()
    recv = _all_to_all(send, group, size)            # (source rank = sequence shard, batch, heads/P, local, dim)
    return recv.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * local, dim)


def _to_sequence(y: torch.Tensor, group, size: int) -> torch.Tensor:
    batch, heads_local, seq, dim = y.shape
    send = y.reshape(batch, heads_local, size, seq // size, dim).permute(2, 0, 1, 3, 4).contiguous()
    recv = _all_to_all(send, group, size)            # (source rank = head chunk, batch, heads/P, local, dim)
    return recv.transpose(0, 1).reshape(batch, size * heads_local, seq // size, dim)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, to_heads):
        ctx.group, ctx.size, ctx.to_heads = group, size, to_heads
        return (_to_heads if to_heads else _to_sequence)(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        back = _to_sequence if ctx.to_heads else _to_heads
        return back(grad.contiguous(), ctx.group, ctx.size), None, None, None


def gather_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``(B, H, S/P, D)`` on each of the ``size`` ranks of ``group`` -> ``(B, H/P, S, D)``: the whole sequence of this
    rank's head-chunk (differentiable; its gradient is `scatter_sequence`).

    Raises:
        ValueError: ``H`` is not divisible by ``size``.
    """
    return x if size == 1 else _Exchange.apply(x, group, size, True)


def scatter_sequence(y: torch.Tensor, group, size: int) -> torch.Tensor:
    """The inverse of `gather_sequence`: ``(B, H/P, S, D)`` -> ``(B, H, S/P, D)`` (differentiable)."""
    return y if size == 1 else _Exchange.apply(y, group, size, False)
