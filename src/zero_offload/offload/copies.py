"""Device <-> host copies, each direction on its own stream and each copy ordered by its own event.

The FSDP2 way (torch.distributed.fsdp's copy-in/all-gather streams): gradient copies down run on a
device-to-host stream, parameter copies up on a host-to-device stream, so neither queues behind the other.
Each copy records an event when it is queued and returns it as a `CopyHandle`:

- before a copy starts, its stream waits on an event recorded on the compute stream at the time of the call
  (the data it reads -- or the buffer it overwrites -- was produced or last used there);
- the compute stream waits only on the handle of the data it is about to use (`CopyHandle.wait_stream`),
  never on a whole copy stream;
- the host reads (or overwrites) a host buffer only after that buffer's handle (`CopyHandle.synchronize`);
- the device-side tensor of each copy is ``record_stream``-ed on the copy stream, so the caching allocator
  does not hand its memory out again before the copy has read it.

On a machine without an accelerator the device is the host: `HostCopies` copies synchronously and every
handle is complete -- the same interface (`Copies`) with streams, events and pinning fallen away. To check
the ordering there anyway, ``ZERO_OFFLOAD_SIMULATE_STREAMS=1`` makes every copy land later on a worker thread
(`zero_offload.offload.simulated`).
"""
from __future__ import annotations

from typing import Protocol

import torch

from zero_offload.offload import simulated
from zero_offload.offload.handles import DONE, CopyHandle, TransferCounts
from zero_offload.offload.pinned import host_alloc_bytes, host_empty

__all__ = ["host_empty", "host_alloc_bytes", "TransferCounts", "CopyHandle", "DONE", "Copies", "CudaCopies",
           "HostCopies", "make_copies"]




class Copies(Protocol):
    """What the optimizer and the gradient partitions need from a copy engine."""
    device: torch.device
    cuda: bool
    synchronous: bool  # every copy has landed when its call returns (the device is the host)
    pin: bool          # host buffers made for copies are page-locked (CUDA with ``pin_memory``)
    counts: "TransferCounts"

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle: ...

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: CopyHandle | None = None) -> CopyHandle: ...

    def compute_point(self) -> CopyHandle: ...

    def upload(self, src: torch.Tensor) -> tuple[torch.Tensor, CopyHandle]: ...

    def uploads_read(self, event) -> None: ...

    def downloads_after(self, handle: CopyHandle) -> None: ...

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def close(self) -> None: ...


class HostCopies:
    """The compute device is the CPU: copies are plain synchronous copies between separate host buffers."""

    cuda = False
    synchronous = True

    def __init__(self, device: torch.device, pin: bool = False):
        self.device, self.pin = device, False      # nothing to page-lock for: the device is the host
        self.counts = TransferCounts()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        dst.copy_(src)
        self.counts.bytes_down += dst.numel() * dst.element_size()
        return DONE

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: CopyHandle | None = None) -> CopyHandle:
        dst.copy_(src)
        self.counts.bytes_up += dst.numel() * dst.element_size()
        return DONE

    def compute_point(self) -> CopyHandle:
        """See `CudaCopies.compute_point`: the host is the compute, already past every point."""
        return DONE

    def upload(self, src: torch.Tensor) -> tuple[torch.Tensor, CopyHandle]:
        """A new device copy of host tensor ``src`` (see `CudaCopies.upload`)."""
        dst = torch.empty_like(src, device=self.device)
        return dst, self.to_device(dst, src)

    def uploads_read(self, event) -> None:
        """See `CudaCopies.uploads_read`: nothing to order on the CPU."""

    def downloads_after(self, handle: CopyHandle) -> None:
        """See `CudaCopies.downloads_after`: copies are synchronous on the CPU."""

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def synchronize(self) -> None:
        """Whole-stream wait (kept for the NVMe optimizer): nothing is in flight on the CPU."""

    def wait_for_copies(self) -> None:
        """Whole-stream wait (kept for the NVMe optimizer): nothing is in flight on the CPU."""

    def close(self) -> None:
        """Nothing to end: no thread, no stream."""


class CudaCopies:
    """Copies on two side streams (device-to-host, host-to-device), each returning its own event.

    Args:
        pin: page-lock the host buffers made by `host_empty` (``offload_*.pin_memory``); with pageable
            buffers every ``non_blocking`` copy still blocks the host.
    """

    cuda = True
    synchronous = False

    def __init__(self, device: torch.device, pin: bool = True):
        self.device, self.pin = device, pin
        self.counts = TransferCounts()
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return host_empty(numel, dtype, self.pin)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        """Copy device tensor ``src`` into host tensor ``dst`` after the compute queued so far produced it."""
        self.counts.bytes_down += dst.numel() * dst.element_size()
        return self._copy(self.d2h, dst, src, device_side=src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: CopyHandle | None = None) -> CopyHandle:
        """Copy host tensor ``src`` into device tensor ``dst`` once the compute queued so far is done with
        ``dst`` (the caller has synchronised the handle of whatever wrote ``src``); with ``after`` (a
        `compute_point`) once the compute queued up to that point is: from a thread other than the one
        feeding the compute stream, whose own current stream says nothing of where the compute stands."""
        self.counts.bytes_up += dst.numel() * dst.element_size()
        return self._copy(self.h2d, dst, src, device_side=dst, after=after)

    def compute_point(self) -> CopyHandle:
        """The compute queued so far on the current stream, as a handle a later copy may wait for (`to_device`'s
        ``after``): the last reader of a device buffer marks it, and the copies that rewrite it wait for it."""
        return CopyHandle(torch.cuda.current_stream(self.device).record_event())

    def upload(self, src: torch.Tensor) -> tuple[torch.Tensor, CopyHandle]:
        """A new device copy of host tensor ``src``, allocated and filled on the host-to-device stream: it waits
        for no compute (the buffer is new; the caller has synchronised whatever wrote ``src``). Returns the
        device tensor and the copy's handle; a stream that reads the tensor waits on the handle, and before the
        tensor is dropped its reader calls `uploads_read`."""
        self.counts.bytes_up += src.numel() * src.element_size()
        with torch.cuda.stream(self.h2d):
            dst = torch.empty_like(src, device=self.device)
            dst.copy_(src, non_blocking=True)
        return dst, CopyHandle(_blocking_event(self.h2d), self.counts)

    def uploads_read(self, event) -> None:
        """The `upload` buffers about to be dropped were last read before ``event`` (recorded on the stream that
        read them): the copy stream waits for it, so the allocator hands their memory to the next upload at once
        and in stream order -- FSDP2's order for its copy-in buffers, where ``record_stream`` would keep each
        block until the host saw the reader pass it, and a host running ahead would allocate anew."""
        self.h2d.wait_event(event)

    def downloads_after(self, handle: CopyHandle) -> None:
        """Copies down queued from now on start after the copy of ``handle`` (a copy up whose host source they
        overwrite: the delayed update publishes from the gradient buffer the next backward fills). The
        device-to-host stream waits for its event; the host does not."""
        if handle.event is not None:
            self.d2h.wait_event(handle.event)

    def synchronize(self) -> None:
        """Block the host until every copy queued so far has finished (a whole-stream wait; the NVMe
        optimizer uses it, the rest of the code waits on single `CopyHandle`s)."""
        self.d2h.synchronize()
        self.h2d.synchronize()

    def wait_for_copies(self) -> None:
        """Order the compute stream after every copy queued so far (a whole-stream wait, see `synchronize`)."""
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.d2h)
        current.wait_stream(self.h2d)

    def close(self) -> None:
        """Let every copy queued land (from `Engine.close`); the streams are CUDA's and need no ending."""
        self.synchronize()

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor, device_side: torch.Tensor,
              after: CopyHandle | None = None) -> CopyHandle:
        if after is None:
            stream.wait_event(torch.cuda.current_stream(self.device).record_event())
        elif after.event is not None:
            stream.wait_event(after.event)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        device_side.record_stream(stream)
        return CopyHandle(_blocking_event(stream), self.counts)


def _blocking_event(stream) -> "torch.cuda.Event":
    """An event recorded on ``stream`` whose host waits yield the core (``cudaEventBlockingSync``) instead of
    spinning: the host Adam kernel and the delayed update's thread need every core while the host waits."""
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


def make_copies(device: torch.device, pin: bool = True) -> Copies:
    """The copies (the `Copies` role) for ``device``: `CudaCopies` on CUDA, `HostCopies` elsewhere -- or,
    elsewhere with ``ZERO_OFFLOAD_SIMULATE_STREAMS`` set, `zero_offload.offload.simulated.SimulatedCopies` (each
    copy lands later, on a worker thread; the variable is read here, once per engine)."""
    if device.type == "cuda":
        return CudaCopies(device, pin)
    return simulated.SimulatedCopies(device, pin) if simulated.enabled() else HostCopies(device, pin)
