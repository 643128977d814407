"""One writer per directory: an exclusive advisory lock (``fcntl.flock``) on ``directory/.lock``.

The lock file holds the holder's pid, so a second writer fails at once naming the directory and the
process in its way. The kernel drops the lock when its holder exits, however it exits (SIGKILL included),
so a lock is never stale. Advisory: it binds processes that take it (every zero-offload save and main job),
on one machine or on a file system with working ``flock`` (most NFS setups emulate it with POSIX locks).
"""
from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

__all__ = ["DirectoryLock", "LockedError", "LOCK_FILE"]

LOCK_FILE = ".lock"
# Seconds a refused writer waits for the holder's pid to appear (it is written just after the lock is taken).
PID_WAIT_S = 5.0


class LockedError(RuntimeError):
    """The directory is locked by another process; the message names it and the holder's pid."""


class DirectoryLock:
    """``with DirectoryLock(path, purpose):`` holds ``path/.lock`` exclusively, creating ``path`` if needed.

    Raises (on entry):
        LockedError: another process holds the lock. Not waited for, except for up to `PID_WAIT_S` while the
            holder has taken it and not yet written its pid (or is letting it go), so the message names the pid.
    """

    def __init__(self, directory: str | os.PathLike, purpose: str = "in use"):
        self.directory = Path(directory)
        self.purpose = purpose
        self._fd: int | None = None

    def acquire(self) -> "DirectoryLock":
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        # The holder writes its pid just after taking the lock and empties the file just before letting it go:
        # a refusal that finds no pid looks again, and takes the lock if it was being let go, for a short while.
        deadline = time.monotonic() + PID_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                busy = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
                if busy and not holder and time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                os.close(fd)
                if busy:
                    raise LockedError(f"'{self.directory}' is {self.purpose} by another process (pid "
                                      f"{holder or 'unknown'}); wait for it to finish or use another "
                                      "directory") from None
                raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "DirectoryLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
