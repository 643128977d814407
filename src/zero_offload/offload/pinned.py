"""Page-locked host memory at its exact size, released without touching the device from a finalizer.

``torch.empty(pin_memory=True)`` goes through torch's caching host allocator, which rounds every request up
to the next power of two (40 GiB of fp32 masters become 64 GiB). `host_empty` instead
allocates a plain host tensor of exactly the bytes asked for and page-locks it in place with
``cudaHostRegister``. Copies from and to registered memory run asynchronously, as from the caching allocator's.
Without CUDA (or with ``pin=False``) it is a plain host tensor.

Release. An asynchronous copy may still read a block when its last tensor is garbage-collected, so the block
must outlive that copy; and a garbage-collector finalizer runs at any allocation of any thread, where a device
synchronisation stalls whatever the program was doing: nothing syncs the device from a finalizer.
So the finalizer of a block only moves it, memory and registration intact, to a list of freed blocks: no
CUDA call at all. The freed blocks are unregistered and dropped at one of two well-defined points, never inside
a finalizer, with one ``torch.cuda.synchronize`` for all of them (every copy queued before is then done):

- the next `host_empty` (engines are built, and their buffers made, outside the step loop);
- `release_freed`, which a program may call when it is done with an engine (after ``del`` and ``gc.collect()``).

A freed block is not handed out again: a view of it may outlive the tensor `host_empty` returned (its
finalizer fires when that tensor goes, not its storage), so reuse could alias live memory; once unregistered,
such a view still owns its memory, only pageable. torch's caching host allocator releases on the same rule (a
block is free once the work queued on it has completed), with per-stream events where this keeps one explicit
synchronisation.
"""
from __future__ import annotations

import warnings
import weakref

import torch

from zero_offload.offload.host_limits import RAISE_MEMLOCK, memlock_limit

__all__ = ["host_empty", "host_alloc_bytes", "is_page_locked", "pinned_bytes", "freed_bytes", "release_freed",
           "PinnedMemoryWarning", "pageable_fallback_bytes"]

_registered: dict[int, int] = {}             # data_ptr -> bytes of live blocks page-locked by host_empty
_freed: list[tuple[torch.Tensor, int]] = []  # (the block's memory, its bytes): garbage, still page-locked
_fallback_bytes = 0                          # bytes meant to be page-locked that stayed pageable
_warned = False


def _cudart():
    return torch.cuda.cudart()


def _on_collect(block: torch.Tensor) -> None:
    """The finalizer of a returned tensor: keep its memory (``block``) on the freed list. No CUDA call."""
    nbytes = _registered.pop(block.data_ptr(), None)
    if nbytes is not None:
        _freed.append((block, nbytes))


def release_freed() -> int:
    """Unregister and drop every page-locked block whose tensor was garbage-collected, after one device
    synchronisation (none when there is nothing to release); returns the bytes released."""
    if not _freed:
        return 0
    torch.cuda.synchronize()           # here, not in a finalizer: no copy still reads a freed block
    nbytes = 0
    while _freed:
        block, n = _freed.pop()
        _cudart().cudaHostUnregister(block.data_ptr())
        nbytes += n
    return nbytes


def freed_bytes() -> int:
    """Bytes of page-locked blocks whose tensors were garbage-collected and that are not yet released."""
    return sum(n for _, n in _freed)


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A 1-D host tensor of exactly ``numel`` elements of ``dtype``, page-locked when ``pin`` and CUDA is
    available (``cudaHostRegister``, no power-of-two rounding). Blocks freed since the last call are released
    first (`release_freed`).

    Where CUDA refuses to page-lock it (a container's or the driver's limit), the tensor stays pageable: training
    goes on with copies that block the host and run slower, and one `PinnedMemoryWarning` per process names the
    bytes, the locked-memory limit and how to raise it (`pageable_fallback_bytes` counts them). Stopping instead
    would end runs on hosts whose limit is not knowable in advance (root's pinning ignores ``RLIMIT_MEMLOCK``; the
    driver and the container runtime set their own), and nothing a run holds is lost by going on.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not (pin and torch.cuda.is_available()) or numel == 0:
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * itemsize
    release_freed()
    block = torch.empty(nbytes, dtype=torch.uint8)
    err = _cudart().cudaHostRegister(block.data_ptr(), nbytes, 0)
    if int(err) != 0:
        return _pageable(block.view(dtype), f"cudaHostRegister failed with CUDA error {int(err)}")
    t = block.view(dtype)
    _registered[block.data_ptr()] = nbytes
    weakref.finalize(t, _on_collect, block)
    return t


class PinnedMemoryWarning(RuntimeWarning):
    """Host buffers meant to be page-locked are pageable: copies to and from the device block and run slower."""


def _pageable(t: torch.Tensor, why: str) -> torch.Tensor:
    """``t``, left pageable because page-locking it failed (``why``); warns once per process."""
    global _fallback_bytes, _warned
    nbytes = t.numel() * t.element_size()
    _fallback_bytes += nbytes
    if not _warned:
        _warned = True
        limit = memlock_limit()
        warnings.warn(PinnedMemoryWarning(
            f"page-locking {nbytes} bytes of host memory failed ({why}) with {pinned_bytes()} bytes page-locked "
            f"by this process (RLIMIT_MEMLOCK: {'unlimited or not binding' if limit is None else f'{limit} bytes'}):"
            f" this and any further buffer that fails stays pageable, and copies to and from the device block "
            f"the host and run slower; {RAISE_MEMLOCK}"), stacklevel=3)
    return t


def pageable_fallback_bytes() -> int:
    """Bytes of host buffers that were to be page-locked and stayed pageable (`host_empty`), in this process."""
    return _fallback_bytes


def host_alloc_bytes(numel: int, dtype: torch.dtype, pin: bool, accelerator: bool) -> int:
    """Bytes of host memory `host_empty(numel, dtype, pin)` takes: exactly ``numel`` x the element size,
    pinned or not (no power-of-two rounding). The memory model (`zero_offload.estimate`) sizes host buffers
    with this, so change both together."""
    return numel * torch.empty((), dtype=dtype).element_size()


def is_page_locked(t: torch.Tensor) -> bool:
    """True when ``t``'s memory was page-locked by `host_empty` (or by torch's pinned allocator)."""
    if not torch.cuda.is_available() or t.is_cuda:
        return False
    return t.untyped_storage().data_ptr() in _registered or t.is_pinned()


def pinned_bytes() -> int:
    """Bytes currently page-locked by `host_empty` in this process for live tensors (freed blocks not yet
    released are `freed_bytes`)."""
    return sum(_registered.values())
