"""Page-locked host memory at its exact size.

``torch.empty(pin_memory=True)`` goes through torch's caching host allocator, which rounds every request up
to the next power of two (40 GiB of fp32 masters at 10B parameters become 64 GiB). `host_empty` instead
allocates a plain host tensor of exactly the bytes asked for and page-locks it in place with
``cudaHostRegister``; the registration is undone (``cudaHostUnregister``) when the returned tensor is
garbage-collected. Copies from and to registered memory run asynchronously, as from the caching allocator's.
Without CUDA (or with ``pin=False``) it is a plain host tensor.
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["host_empty", "host_alloc_bytes", "is_page_locked", "pinned_bytes"]

_registered: dict[int, int] = {}   # data_ptr -> bytes page-locked by host_empty and not yet released


def _cudart():
    return torch.cuda.cudart()


def _unregister(ptr: int) -> None:
    if _registered.pop(ptr, None) is None:
        return
    # An asynchronous copy may still read the range: let it finish before the pages become pageable again.
    torch.cuda.synchronize()
    _cudart().cudaHostUnregister(ptr)


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A 1-D host tensor of exactly ``numel`` elements of ``dtype``, page-locked when ``pin`` and CUDA is
    available (``cudaHostRegister``, no power-of-two rounding).

    Raises:
        RuntimeError: CUDA refused to page-lock the range (the message gives the bytes and CUDA's error).
    """
    t = torch.empty(numel, dtype=dtype)
    if not (pin and torch.cuda.is_available()) or t.numel() == 0:
        return t
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    err = _cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed with CUDA error "
                           f"{int(err)} (page-locked memory exhausted? set offload_*.pin_memory = false)")
    _registered[ptr] = nbytes
    weakref.finalize(t, _unregister, ptr)
    return t


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
    """Bytes currently page-locked by `host_empty` in this process."""
    return sum(_registered.values())
