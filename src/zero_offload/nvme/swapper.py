"""`Swapper`: asynchronous reads and writes between aligned host buffers and swap files.

Life cycle (DeepSpeed's ``AsyncIOBuilder`` handle and its ``swap_tensor`` helpers play this role there):
``open`` a file per swapped tensor, ``read`` ahead and ``write`` behind (each returns a `Pending` at once),
``wait`` for one, ``flush`` waits for all, ``close`` waits, closes and deletes the files.

Where the native AIO path is built (`zero_offload.nvme._native`, Linux), a request is cut into ``thread_count``
contiguous parts, each moved by one call that keeps ``queue_depth`` blocks of ``block_size`` bytes in flight with
io_submit, as each thread of DeepSpeed's aio handle does. Reads and writes have ``thread_count`` threads each, as
DeepSpeed's pipelined optimizer swapper keeps one aio handle per direction, so a write-behind never queues behind
a read-ahead. Elsewhere every request is cut into ``block_size`` pieces run by ``thread_count x queue_depth``
Python threads doing blocking ``os.preadv`` / ``os.pwritev``. Both release the GIL, so the host step and the I/O
overlap. Files are opened with ``O_DIRECT`` (no page cache: the disk's bandwidth, and no host memory grows
with the model) where the filesystem accepts it, checked at open with a probe; elsewhere (tmpfs, some network
filesystems) with buffered I/O and one warning. Errors from the disk (ENOSPC, EIO, ...) are raised as
`NvmeIOError`, which names the file.

Under ``ZERO_OFFLOAD_SIMULATE_STREAMS=1`` (read when the swapper is made) each piece waits a random few
milliseconds on its I/O thread before it moves, so a buffer read before its request's `Swapper.wait`, or
rewritten while a write is in flight, shows; ``..._SKIP_WAITS=1`` makes `wait` return at once
(`zero_offload.offload.simulated`).
"""
from __future__ import annotations

import atexit
import errno as errno_mod
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import util as mp_util
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zero_offload.nvme import _native
from zero_offload.nvme.buffers import ALIGNMENT, AlignedBuffer, align_up
from zero_offload.offload import simulated

__all__ = ["NvmeIOError", "SwapFile", "Pending", "Swapper"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class NvmeIOError(OSError):
    """A read or write of a swap file failed; ``filename`` is the file, ``errno`` the cause (ENOSPC, EIO)."""


@dataclass
class SwapFile:
    """One open swap file: its path, descriptor, size in bytes and whether it bypasses the page cache."""
    path: Path
    fd: int
    nbytes: int
    direct: bool


@dataclass
class Pending:
    """An outstanding read or write: its pieces' futures. `Swapper.wait` completes it."""
    futures: list[Future] = field(default_factory=list)

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


# Swap directories in use by a live `Swapper` of this process, with how many hold each: a directory is removed at
# `close` only by its last holder (an engine collected late must not remove the directory a new engine is filling).
_LIVE_LOCK = threading.Lock()
_LIVE: dict[Path, int] = {}


class Swapper:
    """Swap files under ``directory``, read and written through ``thread_count`` I/O threads.

    Args:
        directory: where the files live (created if missing).
        block_size: bytes per piece of a request (aio ``block_size``; DeepSpeed's default 1 MiB).
        thread_count: I/O threads (aio ``intra_op_parallelism`` / ``thread_count``; default 1).
        queue_depth: blocks each thread keeps in flight (aio ``queue_depth``), with io_submit on the native path;
            on the portable path each is a blocking ``preadv``/``pwritev`` on its own worker.
        use_direct: try O_DIRECT at open (falls back to buffered I/O with one warning).
        native: use the native AIO path where it is built (False: always the portable one).

    Raises:
        NvmeIOError: from `open`, `wait`, `flush` -- naming the file, with the OS error's errno.
    """

    def __init__(self, directory: str | os.PathLike, block_size: int = 1 << 20, thread_count: int = 1,
                 use_direct: bool = True, queue_depth: int = 1, native: bool = True):
        if block_size < ALIGNMENT or block_size % ALIGNMENT:
            raise ValueError(f"Swapper: block_size must be a positive multiple of {ALIGNMENT} bytes, "
                             f"got {block_size}")
        if thread_count < 1 or queue_depth < 1:
            raise ValueError(f"Swapper: thread_count and queue_depth must be >= 1, got {thread_count}, "
                             f"{queue_depth}")
        self.directory = Path(directory)
        with _LIVE_LOCK:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._key = self.directory.resolve()
            _LIVE[self._key] = _LIVE.get(self._key, 0) + 1
        self.block_size, self.use_direct = block_size, use_direct and bool(_O_DIRECT)
        self.thread_count, self.queue_depth = thread_count, queue_depth
        self.files: dict[str, SwapFile] = {}
        self.native = native and _native.available()
        if self.native:
            self.pools = {w: ThreadPoolExecutor(thread_count, thread_name_prefix=f"zero-offload-nvme-{'wr'[w]}")
                          for w in (False, True)}
        else:
            shared = ThreadPoolExecutor(thread_count * queue_depth, thread_name_prefix="zero-offload-nvme")
            self.pools = {False: shared, True: shared}
        self.pending: list[Pending] = []
        self.bytes_read = self.bytes_written = 0
        self._lock = threading.Lock()
        self._warned = False
        self._closed = False
        self._pid = os.getpid()
        self.simulated, self.skip_waits = simulated.enabled(), simulated.waits_skipped()
        atexit.register(_close_at_exit, weakref.ref(self))
        # A forked multiprocessing child leaves through os._exit (no atexit) after running these finalizers.
        mp_util.Finalize(None, _close_at_exit, args=(weakref.ref(self),), exitpriority=10)

    # -- open / close ----------------------------------------------------------------------------------
    def open(self, name: str, nbytes: int) -> SwapFile:
        """Create (or truncate) file ``name`` of ``nbytes`` bytes, sparse: unwritten ranges read as zeros."""
        path = self.directory / name
        fd, direct = self._open_fd(path)
        try:
            os.ftruncate(fd, nbytes)
        except OSError as e:
            os.close(fd)
            raise _io_error(e, "size", path, nbytes, 0) from e
        f = SwapFile(path, fd, nbytes, direct)
        self.files[name] = f
        return f

    def _open_fd(self, path: Path) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        if self.use_direct:
            try:
                fd = os.open(path, flags | _O_DIRECT, 0o600)
                if self._probe_direct(fd):
                    return fd, True
                os.close(fd)
            except OSError as e:
                if e.errno not in (errno_mod.EINVAL, errno_mod.EOPNOTSUPP):
                    raise _io_error(e, "open", path, 0, 0) from e
            if not self._warned:
                self._warned = True
                warnings.warn(f"zero_offload: '{self.directory}' does not accept O_DIRECT; NVMe swap files use "
                              "buffered I/O (through the page cache) instead", RuntimeWarning, stacklevel=3)
        try:
            return os.open(path, flags, 0o600), False
        except OSError as e:
            raise _io_error(e, "open", path, 0, 0) from e

    @staticmethod
    def _probe_direct(fd: int) -> bool:
        """One aligned block written and read back: some filesystems accept the flag at open, not the I/O."""
        buf = AlignedBuffer(ALIGNMENT)
        view = memoryview(buf.raw.numpy())
        try:
            os.pwritev(fd, [view], 0)
            os.preadv(fd, [view], 0)
            os.ftruncate(fd, 0)
            return True
        except OSError as e:
            if e.errno in (errno_mod.EINVAL, errno_mod.EOPNOTSUPP):
                return False
            raise

    def close(self) -> None:
        """Wait for all requests, close and delete every file. Safe to call twice. A write that fails now
        is not raised: the files are scratch and go in any case (errors surface at `wait` and `flush`). In a
        process forked from the swapper's own, only that process's descriptors are closed: nothing is waited for
        and no file is deleted."""
        if self._closed:
            return
        self._closed = True
        if self._pid != os.getpid():
            # A forked child's copy (its garbage collector can reach one the parent had not yet collected): the
            # I/O threads are not in this process, so a request in flight would be waited for forever, and the
            # files are the parent's. Only this process's copies of the descriptors are closed.
            for f in self.files.values():
                os.close(f.fd)
            return
        try:
            self.flush()
        except NvmeIOError:
            pass
        finally:
            for pool in set(self.pools.values()):
                pool.shutdown(wait=True)
            for f in self.files.values():
                os.close(f.fd)
                f.path.unlink(missing_ok=True)
            self.files.clear()
            with _LIVE_LOCK:
                _LIVE[self._key] -= 1
                if _LIVE[self._key] == 0:
                    del _LIVE[self._key]
                    try:
                        self.directory.rmdir()          # only when empty: never someone else's files
                    except OSError:
                        pass

    # -- read-ahead / write-behind ---------------------------------------------------------------------
    def read(self, name: str, dst: torch.Tensor, offset: int = 0) -> Pending:
        """Start reading ``dst.nbytes`` bytes at byte ``offset`` of file ``name`` into ``dst`` (contiguous,
        CPU; aligned to 4096 with its length and ``offset`` for an O_DIRECT file)."""
        return self._submit(name, dst, offset, write=False)

    def write(self, name: str, src: torch.Tensor, offset: int = 0) -> Pending:
        """Start writing ``src`` (contiguous CPU tensor) at byte ``offset`` of file ``name``.
        ``src`` must not change until the request is waited for."""
        return self._submit(name, src, offset, write=True)

    def wait(self, pending: Pending | None) -> None:
        """Block until ``pending`` completes; re-raise its first error as `NvmeIOError`."""
        if pending is None:
            return
        if self.skip_waits and not self._closed:     # fault injection (the simulation's skipped waits)
            with self._lock:
                if pending in self.pending:
                    self.pending.remove(pending)
            return
        error = None
        for fut in pending.futures:
            e = fut.exception()
            error = error or e
        with self._lock:
            if pending in self.pending:
                self.pending.remove(pending)
        if error is not None:
            raise error

    def flush(self) -> None:
        """Wait for every outstanding request; raise the first error."""
        error = None
        while self.pending:
            try:
                self.wait(self.pending[0])
            except NvmeIOError as e:
                error = error or e
        if error is not None:
            raise error

    def _submit(self, name: str, tensor: torch.Tensor, offset: int, write: bool) -> Pending:
        if self._closed:
            raise RuntimeError(f"Swapper for '{self.directory}' is closed")
        f = self.files[name]
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("Swapper: tensors must be contiguous CPU tensors")
        nbytes = tensor.numel() * tensor.element_size()
        if offset < 0 or offset + nbytes > f.nbytes:
            raise ValueError(f"Swapper: {nbytes} bytes at offset {offset} exceed '{f.path}' ({f.nbytes} bytes)")
        if f.direct and (offset % ALIGNMENT or nbytes % ALIGNMENT or tensor.data_ptr() % ALIGNMENT):
            raise ValueError(f"Swapper: O_DIRECT I/O on '{f.path}' needs address, offset and length aligned to "
                             f"{ALIGNMENT} bytes (offset {offset}, length {nbytes})")
        flat = tensor.view(-1).view(torch.uint8) if nbytes else tensor
        pending = Pending()
        if self.native:                 # one part per thread, each with queue_depth blocks in flight
            step = align_up(-(-nbytes // self.thread_count), self.block_size)
            run, extra = _native_transfer, (self.block_size, self.queue_depth)
        else:
            step, run, extra = self.block_size, _transfer, ()
        if self.simulated:
            run, extra = _delayed, (run, *extra)
        for lo in range(0, nbytes, step):
            hi = min(nbytes, lo + step)
            pending.futures.append(self.pools[write].submit(run, f, flat[lo:hi], offset + lo, write, *extra))
        with self._lock:
            self.pending.append(pending)
            if write:
                self.bytes_written += nbytes
            else:
                self.bytes_read += nbytes
        return pending


def _transfer(f: SwapFile, piece: torch.Tensor, offset: int, write: bool) -> None:
    """Run on an I/O thread: the whole piece, retrying short transfers (the GIL is released inside)."""
    view = memoryview(piece.numpy()).cast("B")
    done, n = 0, len(view)
    try:
        while done < n:
            if write:
                got = os.pwritev(f.fd, [view[done:]], offset + done)
            else:
                got = os.preadv(f.fd, [view[done:]], offset + done)
                if got == 0:            # past the end of a shorter file: the rest reads as zeros
                    piece[done:].zero_()
                    return
            done += got
    except OSError as e:
        raise _io_error(e, "write" if write else "read", f.path, n, offset) from e


def _delayed(f: SwapFile, piece: torch.Tensor, offset: int, write: bool, run, *extra) -> None:
    """Run on an I/O thread under simulated streams: ``run`` after a random delay of a few milliseconds."""
    simulated.count("io")
    time.sleep(simulated.random_delay())
    run(f, piece, offset, write, *extra)


def _native_transfer(f: SwapFile, piece: torch.Tensor, offset: int, write: bool, block_size: int,
                     queue_depth: int) -> None:
    """Run on an I/O thread: the whole piece through the native AIO path (ctypes releases the GIL)."""
    n = piece.numel()
    rc = _native.transfer(f.fd, piece.data_ptr(), n, offset, block_size, queue_depth, write)
    if rc == -errno_mod.ENOSYS:         # no native AIO in this kernel: the portable path
        return _transfer(f, piece, offset, write)
    if rc < 0:
        e = OSError(-rc, os.strerror(-rc))
        raise _io_error(e, "write" if write else "read", f.path, n, offset) from e


def _io_error(e: OSError, op: str, path: Path, nbytes: int, offset: int) -> NvmeIOError:
    err = NvmeIOError(e.errno, f"NVMe swap {op} of {nbytes} bytes at offset {offset} failed: "
                               f"{e.strerror or e}", str(path))
    return err


def _close_at_exit(ref) -> None:
    swapper = ref()
    if swapper is not None:
        try:
            swapper.close()
        except Exception:   # at exit: the files go in any case
            for f in swapper.files.values():
                f.path.unlink(missing_ok=True)
