"""Device <-> host copies on a side stream, so transfers overlap accelerator compute.

On CUDA, copies run on a dedicated stream into or out of pinned host memory and are ordered with the
compute stream by events. On a machine without an accelerator the device *is* the host: copies are plain,
synchronous copies between separate host buffers, and streams and pinning fall away.
"""
from __future__ import annotations

import torch

__all__ = ["host_empty", "host_alloc_bytes", "CopyEngine"]


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A 1-D host tensor of ``numel`` elements, page-locked when ``pin`` and CUDA is present."""
    pin = pin and torch.cuda.is_available()
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


def host_alloc_bytes(numel: int, dtype: torch.dtype, pin: bool, accelerator: bool) -> int:
    """Bytes of host memory `host_empty(numel, dtype, pin)` takes: exact when unpinned; a pinned block from
    torch's caching host allocator is rounded up to a power of two. The memory model
    (`zero_offload.estimate`) sizes host buffers with this, so change both together."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if pin and accelerator and nbytes > 0:
        return 1 << (nbytes - 1).bit_length()
    return nbytes


class CopyEngine:
    """Asynchronous copies between the compute device and host memory.

    ``to_host``/``to_device`` enqueue on the copy stream after everything already queued on the compute
    stream; ``wait_for_copies`` makes the compute stream wait for them, ``synchronize`` makes the host wait.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy device tensor ``src`` into host tensor ``dst`` (same shape)."""
        self._copy(dst, src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host tensor ``src`` into device tensor ``dst`` (same shape)."""
        self._copy(dst, src)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self.cuda:
            dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        # Keep the device-side tensor alive until the copy stream is done with it.
        (src if src.is_cuda else dst).record_stream(self.stream)

    def wait_for_copies(self) -> None:
        """Order the compute stream after every copy queued so far."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        """Block the host until every queued copy has finished (before the host reads what came down)."""
        if self.cuda:
            self.stream.synchronize()
