"""A small ring of pinned host chunks that updated 16-bit parameters pass through on their way up.

Instead of a full-size 16-bit host copy of the partition (2 bytes/param), the host step's finished fp32
chunks are rounded into the next slot of a few chunk-sized pinned buffers and copied up from there; a slot
is rewritten only once its previous copy's event has fired. Host memory: ``slots x chunk`` elements,
independent of the model size.
"""
from __future__ import annotations

import math

import torch

from zero_offload.offload.copies import DONE, CopyHandle, Copies

__all__ = ["StagingRing", "ring_shape"]

SLOT_NUMEL, SLOTS = 1 << 21, 4


def ring_shape(largest: int, slot_numel: int | None = None, slots: int = SLOTS) -> tuple[int, int]:
    """(slot count, elements per slot) of the ring for tensors of at most ``largest`` elements (``slot_numel``
    default: the module's `SLOT_NUMEL`, read at the call); the memory model (`zero_offload.estimate`) sizes the
    ring with this too."""
    slot_numel = max(1, min(SLOT_NUMEL if slot_numel is None else slot_numel, largest))
    return max(1, min(slots, math.ceil(largest / slot_numel))), slot_numel


class StagingRing:
    """``slots`` pinned host buffers of ``slot_numel`` elements of ``dtype``, reused round-robin.

    Args:
        copies: the copy engine (its ``host_empty`` pins; its ``to_device`` queues the copies up).
        largest: elements of the largest tensor that will pass through (caps the slot size).
    """

    def __init__(self, copies: Copies, dtype: torch.dtype, largest: int, slot_numel: int | None = None,
                 slots: int = SLOTS):
        self.copies = copies
        count, self.slot_numel = ring_shape(largest, slot_numel, slots)
        self.slots = [copies.host_empty(self.slot_numel, dtype) for _ in range(count)]
        self.handles: list[CopyHandle] = [DONE] * count
        self.next = 0
        self.last: CopyHandle = DONE

    def copy_up(self, dst: torch.Tensor, src: torch.Tensor, after: CopyHandle | None = None) -> CopyHandle:
        """Round host ``src`` (1-D, any float dtype) into slots and copy them into device ``dst`` (same
        numel), after ``after`` (`Copies.to_device`); returns the handle of the last copy (copies on one stream
        finish in order)."""
        for lo in range(0, src.numel(), self.slot_numel):
            hi = min(src.numel(), lo + self.slot_numel)
            i, self.next = self.next, (self.next + 1) % len(self.slots)
            self.handles[i].synchronize()          # the slot's previous copy has read it
            slot = self.slots[i][:hi - lo]
            slot.copy_(src[lo:hi])
            self.handles[i] = self.last = self.copies.to_device(dst[lo:hi], slot, after)
        return self.last

    def synchronize(self) -> None:
        """Block until every copy out of the ring has finished."""
        for h in self.handles:
            h.synchronize()

    def tensors(self) -> list[torch.Tensor]:
        return list(self.slots)
