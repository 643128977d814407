"""Host buffers aligned for O_DIRECT, and a fixed pool of them.

O_DIRECT transfers need the buffer address, the file offset and the length to be multiples of the logical
block size; 4096 bytes covers every common device (DeepSpeed's aio handle aligns the same way).
"""
from __future__ import annotations

import torch

from zero_offload.offload.pinned import host_empty

__all__ = ["ALIGNMENT", "align_up", "AlignedBuffer", "BufferPool"]

ALIGNMENT = 4096


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


class AlignedBuffer:
    """``nbytes`` (rounded up to 4096) of host memory whose address is a multiple of 4096, page-locked with
    ``pin`` when CUDA is present (DeepSpeed pins its swap buffers: copies to and from the device then run
    asynchronously, straight from the buffer).

    Attributes:
        raw: the uint8 tensor of shape (nbytes,) at the aligned address; `view` gives typed views.
    """

    def __init__(self, nbytes: int, pin: bool = False):
        self.nbytes = align_up(max(nbytes, 1))
        # Written once here so the whole buffer is resident from the start, as page-locked buffers are: the
        # memory it costs is known at initialize (`estimate_memory` counts it), not discovered mid-run.
        self._storage = host_empty(self.nbytes + ALIGNMENT, torch.uint8, pin).zero_()
        skip = (-self._storage.data_ptr()) % ALIGNMENT
        self.raw = self._storage[skip:skip + self.nbytes]
        assert self.raw.data_ptr() % ALIGNMENT == 0

    def view(self, dtype: torch.dtype, numel: int, byte_offset: int = 0) -> torch.Tensor:
        """A 1-D ``dtype`` tensor of ``numel`` elements starting ``byte_offset`` bytes in (shares memory)."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if byte_offset + nbytes > self.nbytes:
            raise ValueError(f"AlignedBuffer: a view of {nbytes} bytes at {byte_offset} exceeds {self.nbytes} bytes")
        return self.raw[byte_offset:byte_offset + nbytes].view(dtype)


class BufferPool:
    """``count`` aligned buffers of ``nbytes`` each, handed out in turn (round robin).

    The pool bounds the host memory of everything swapped through it: ``count x nbytes`` bytes (page-locked
    with ``pin`` when CUDA is present).
    """

    def __init__(self, count: int, nbytes: int, pin: bool = False):
        if count < 1:
            raise ValueError(f"BufferPool: count must be >= 1, got {count}")
        self.buffers = [AlignedBuffer(nbytes, pin) for _ in range(count)]
        self._next = 0

    def __len__(self) -> int:
        return len(self.buffers)

    def next(self) -> tuple[int, AlignedBuffer]:
        """The next buffer in turn and its index."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        return i, self.buffers[i]

    @property
    def nbytes(self) -> int:
        """Bytes held by the whole pool."""
        return sum(b.nbytes for b in self.buffers)
