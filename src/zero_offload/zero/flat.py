"""Flat parameter buffers: one aligned, padded buffer per param group, with the parameters as views into it.

The buffer is split into ``world_size`` equal, contiguous partitions so every rank can name what it owns by
offsets (ZeRO paper, Sec. 5: each data-parallel rank updates only its 1/N of the parameters).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ALIGNMENT", "ParamSlot", "FlatParams", "pack", "padded_numel", "partition_numel"]

# Partitions start on multiples of 64 elements: 128 bytes of bf16, a whole number of AVX-512 vectors and
# cache lines for the host kernel, and aligned enough for NCCL.
ALIGNMENT = 64


def padded_numel(numel: int, world_size: int, alignment: int = ALIGNMENT) -> int:
    """``numel`` elements padded up to a multiple of ``alignment x world_size`` (at least one such unit), so
    ``world_size`` equal, aligned partitions tile the buffer. The one padding rule of every flat buffer:
    `FlatParams`, stage-3 units and `zero_offload.estimate` all size memory with it."""
    unit = alignment * world_size
    return max(1, math.ceil(numel / unit)) * unit


def partition_numel(numels, world_size: int, alignment: int = ALIGNMENT) -> int:
    """Elements in each rank's partition of a flat buffer packing tensors of ``numels`` elements (an iterable
    of ints) back to back: ``padded_numel(sum(numels), world_size) // world_size``."""
    return padded_numel(sum(numels), world_size, alignment) // world_size


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its group's flat buffer."""
    index: int          # position in the model's parameter order (registration order)
    name: str
    offset: int         # first element in the flat buffer
    numel: int
    shape: torch.Size

    @property
    def end(self) -> int:
        return self.offset + self.numel


def pack(params: list[torch.nn.Parameter], indices: list[int], names: list[str], world_size: int,
         alignment: int = ALIGNMENT) -> tuple[list[ParamSlot], int, int]:
    """Lay parameters back to back: their slots, the element count, and that count padded up to a
    multiple of ``alignment x world_size`` (so ``world_size`` equal, aligned partitions tile it)."""
    slots, offset = [], 0
    for p, idx, name in zip(params, indices, names):
        slots.append(ParamSlot(idx, name, offset, p.numel(), p.shape))
        offset += p.numel()
    return slots, offset, padded_numel(offset, world_size, alignment)


class FlatParams:
    """One param group's parameters packed into a flat buffer of ``padded_numel`` elements.

    Layout: parameters back to back in model order, then zero padding up to a multiple of
    ``ALIGNMENT x world_size`` elements, so each of the ``world_size`` partitions has
    ``partition_numel`` elements (a multiple of ALIGNMENT) and the padding is < ALIGNMENT x world_size.
    After construction each parameter's ``.data`` is a view into ``buffer``.

    Args:
        params: the group's trainable parameters, already on the compute device in the training dtype.
        indices, names: each parameter's model-order index and qualified name.
    """

    def __init__(self, params: list[torch.nn.Parameter], indices: list[int], names: list[str],
                 world_size: int, alignment: int = ALIGNMENT):
        if not params:
            raise ValueError("FlatParams needs at least one parameter")
        self.world_size = world_size
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.params = list(params)
        self.slots, self.numel, self.padded_numel = pack(params, indices, names, world_size, alignment)
        self.partition_numel = partition_numel([self.numel], world_size, alignment)
        self.buffer = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        for p, slot in zip(params, self.slots):
            view = self.buffer[slot.offset:slot.end]
            view.copy_(p.data.reshape(-1))
            p.data = view.view(slot.shape)

    def partition_range(self, rank: int) -> tuple[int, int]:
        """Element range [lo, hi) of ``rank``'s partition in the flat buffer."""
        lo = rank * self.partition_numel
        return lo, lo + self.partition_numel
