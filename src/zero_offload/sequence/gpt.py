"""Ulysses for zero-offload's own GPT (`zero_offload.train.model`): its attention cores wrapped from outside, and
each rank's shard of a batch.

`make_sequence_parallel` replaces each block's ``attend`` (the core ``(q, k, v, dropout_p) -> y`` on
``(B, heads, T, head_dim)``) by one that gathers the whole sequence for ``heads / P`` heads, attends causally and
scatters back (`zero_offload.sequence.exchange`); the model's code is unchanged. `shard` gives a rank its
consecutive ``T / P`` positions of a batch every rank of its group loaded alike, with their position ids.
`sequence_parallel_off` lets evaluation and sampling run whole sequences on every rank.
"""
from __future__ import annotations

import contextlib

import torch

from zero_offload.sequence.exchange import gather_sequence, scatter_sequence
from zero_offload.sequence.groups import SequenceParallelGroups

__all__ = ["UlyssesCore", "make_sequence_parallel", "sequence_parallel_off", "shard"]


class UlyssesCore:
    """An attention core made sequence parallel over ``groups`` (off: the core itself runs)."""

    def __init__(self, core, groups: SequenceParallelGroups):
        self.core, self.groups, self.enabled = core, groups, True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        if not self.enabled:
            return self.core(q, k, v, dropout_p)
        group, size = self.groups.group, self.groups.size
        q, k, v = (gather_sequence(t, group, size) for t in (q, k, v))
        return scatter_sequence(self.core(q, k, v, dropout_p), group, size)


def _cores(model: torch.nn.Module) -> list[UlyssesCore]:
    return [m.attend for m in model.modules() if isinstance(getattr(m, "attend", None), UlyssesCore)]


def make_sequence_parallel(model: torch.nn.Module, groups: SequenceParallelGroups) -> torch.nn.Module:
    """Wrap every ``attend`` of ``model`` (in place; returned). Size 1 changes nothing.

    Raises:
        ValueError: a module whose ``n_head`` is not divisible by the size.
    """
    if groups.size == 1:
        return model
    for m in model.modules():
        if callable(getattr(m, "attend", None)) and not isinstance(m.attend, UlyssesCore):
            if getattr(m, "n_head", groups.size) % groups.size:
                raise ValueError(f"Ulysses needs the head count ({m.n_head}) divisible by the sequence-parallel "
                                 f"size ({groups.size})")
            m.attend = UlyssesCore(m.attend, groups)
    return model


@contextlib.contextmanager
def sequence_parallel_off(model: torch.nn.Module):
    """Inside, every rank runs whole sequences (no exchange): evaluation and generation of the main job."""
    cores = _cores(model)
    for c in cores:
        c.enabled = False
    try:
        yield
    finally:
        for c in cores:
            c.enabled = True


def shard(x: torch.Tensor, y: torch.Tensor, groups: SequenceParallelGroups
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's ``(x, y, position_ids)`` of a ``(B, T)`` batch its group shares (targets already shifted, so
    no label is lost at a shard's edge); position_ids None at size 1.

    Raises:
        ValueError: ``T`` is not divisible by the size.
    """
    if groups.size == 1:
        return x, y, None
    length = x.shape[1]
    if length % groups.size:
        raise ValueError(f"sequence length {length} is not divisible by the sequence-parallel size {groups.size}")
    chunk = length // groups.size
    lo = chunk * groups.get_sequence_parallel_rank()
    return x[:, lo:lo + chunk], y[:, lo:lo + chunk], torch.arange(lo, lo + chunk, device=x.device)
