"""The swapper's native AIO path (`aio.c`, built by setup.py as ``_aio``; see `zero_offload.native`).

`transfer` moves one request with ``queue_depth`` blocks in flight. AIO contexts are kept in a process-wide
pool and reused (making and destroying one costs about as much as a request in a virtual machine); a forked
child starts with an empty pool, since the kernel does not carry a parent's contexts across fork.
`available()` is False when the library was not built, cannot be loaded, or ``ZERO_OFFLOAD_NO_NATIVE=1``;
`zero_offload.nvme.Swapper` then moves data with ``os.preadv`` / ``os.pwritev`` on Python threads.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path

from zero_offload.native_files import native_disabled, shared_library

__all__ = ["available", "transfer"]

_UNSET = object()
_lib: ctypes.CDLL | None | object = _UNSET
_free: dict[int, list[int]] = {}       # queue depth -> idle contexts
_lock = threading.Lock()


def _load() -> ctypes.CDLL | None:
    global _lib
    if _lib is not _UNSET:
        return _lib  # type: ignore[return-value]
    _lib = None
    path = shared_library(Path(__file__).parent, "_aio")
    if native_disabled() or path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    lib.zo_aio_open.restype = lib.zo_aio_close.restype = lib.zo_aio_transfer.restype = ctypes.c_int
    lib.zo_aio_open.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    lib.zo_aio_close.argtypes = [ctypes.c_uint64]
    lib.zo_aio_transfer.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    _lib = lib
    return lib


def available() -> bool:
    """True when the native path can be used in this process."""
    return _load() is not None


def transfer(fd: int, address: int, nbytes: int, offset: int, block_size: int, queue_depth: int,
             write: bool) -> int:
    """Move ``nbytes`` between host ``address`` and byte ``offset`` of ``fd``; blocks (without the GIL) until
    done. Returns 0 or -errno (-ENOSYS: no native AIO here). Requires `available()`."""
    lib = _load()
    with _lock:
        idle = _free.setdefault(queue_depth, [])
        ctx = idle.pop() if idle else None
    if ctx is None:
        handle = ctypes.c_uint64(0)
        rc = lib.zo_aio_open(queue_depth, ctypes.byref(handle))
        if rc < 0:
            return rc if rc != -errno.EINVAL else -errno.ENOSYS
        ctx = handle.value
    rc = lib.zo_aio_transfer(ctx, fd, address, nbytes, offset, block_size, queue_depth, int(write))
    if rc < 0:
        lib.zo_aio_close(ctx)       # may still hold requests after a failure: waited for and dropped
    else:
        with _lock:
            _free[queue_depth].append(ctx)
    return rc


def _forget_in_child() -> None:
    global _free, _lock
    _free, _lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
