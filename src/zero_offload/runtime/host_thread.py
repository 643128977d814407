"""`HostThread`: the one kind of thread the engine starts. Each has an owner that closes it, and none outlives
the interpreter inside torch.

Every piece of host-side background work (the staged gradient adds, the delayed update's host step, the
simulated streams' copies and collectives) runs on a `HostThread`: one persistent worker that runs what is
submitted to it in submission order. It is a one-worker `concurrent.futures.ThreadPoolExecutor`, which gives
the ending rules this needs:

- the worker is not a daemon. At interpreter exit, before any non-daemon thread is joined and before `atexit`
  runs, the standard library's exit hook for executors lets each worker run what is queued and end;
  the interpreter then finalizes with no thread of ours inside torch. A daemon thread inside torch's C++ at
  that point is made to exit by a forced unwind through C++ frames, which aborts the process with
  "terminate called without an active exception";
- the worker is made once, on the first submit, and kept: no thread (and no OpenMP team) is created per step;
- `close` (called by the owner, from `Engine.close`) runs what is queued and joins the worker. An owner that is
  garbage-collected without `close` lets the worker end on its own after its queue (the executor's weak
  reference), and the interpreter still joins it at exit.

A forked child gets a new worker on its first submit (the parent's is not in the child). On CUDA the worker
binds ``device`` first, since the current device is per host thread. A task's exception is kept and the
tasks after it still run (each may free a buffer the training thread waits for); `join` re-raises the first.
PyTorch's FSDP2 and DeepSpeed run their host-side work on the training thread or on CUDA streams and have no
such thread; DeepSpeed's AIO handles join their C++ threads in the handle's destructor.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

__all__ = ["HostThread", "HostThreadError", "HostThreadClosed"]


class HostThreadError(RuntimeError):
    """A task submitted to a `HostThread` failed; chained to the task's exception."""


class HostThreadClosed(RuntimeError):
    """Work was submitted to a `HostThread` after its owner closed it."""


class HostThread:
    """One persistent host worker thread that runs submitted work in order (see the module docstring).

    Args:
        name: the thread's name (``zero_offload-<name>``), shown by debuggers and `threading.enumerate`.
        device: the device whose CUDA context the worker binds (ignored for CPU devices); None: none.
        cpus: the cores the worker is pinned to (`zero_offload.offload.host_cores`), where the OS allows;
            None: wherever the process runs.
    """

    def __init__(self, name: str, device: torch.device | None = None, cpus: tuple[int, ...] | None = None):
        self.name, self.device, self.cpus = name, device, cpus
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._last: Future | None = None
        self._queued = 0                  # tasks submitted and not yet finished
        self._error: BaseException | None = None
        self.closed = False

    @property
    def queued(self) -> int:
        """Tasks submitted and not yet finished."""
        return self._queued

    @property
    def busy(self) -> bool:
        """True while submitted work has not finished."""
        return self._queued > 0

    @property
    def alive(self) -> bool:
        """True while this process's worker thread exists (between the first submit and `close`)."""
        return self._executor is not None and self._pid == os.getpid()

    def submit(self, task: Callable[[], None]) -> Future:
        """Queue ``task`` to run after everything queued before it; returns its future (its exception, if any,
        is also kept for `join`).

        Raises:
            HostThreadClosed: the owner closed this thread.
        """
        with self._lock:
            if self.closed:
                raise HostThreadClosed(f"host thread {self.name!r} was closed by its owner; no work can be queued")
            if self._executor is None or self._pid != os.getpid():
                self._pid, self._queued, self._last = os.getpid(), 0, None
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"zero_offload-{self.name}",
                                                    initializer=self._bind)
            self._queued += 1
            self._last = self._executor.submit(self._run, task)
            return self._last

    def join(self) -> None:
        """Block until every task submitted so far has run.

        Raises:
            HostThreadError: a task failed (chained to the first such exception; cleared once raised).
        """
        last = self._last
        if last is not None and self._pid == os.getpid():
            last.exception()                 # waits; the error itself is kept in self._error
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise HostThreadError(f"a task on host thread {self.name!r} failed") from error

    def close(self) -> None:
        """Run what is queued, end the worker and join it; later submits raise `HostThreadClosed`. Idempotent.

        Raises:
            HostThreadError: a task failed and no `join` has raised it yet (the thread is closed all the same).
        """
        with self._lock:
            self.closed = True
            executor, self._executor = self._executor, None
        if executor is not None and self._pid == os.getpid():
            executor.shutdown(wait=True)
        self.join()

    def _bind(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cpus)     # pid 0: this thread (Linux); its OpenMP team inherits it

    def _run(self, task: Callable[[], None]) -> None:
        try:
            with torch.no_grad():
                task()
        except BaseException as e:       # kept for join; later tasks still run
            with self._lock:
                if self._error is None:
                    self._error = e
            raise
        finally:
            with self._lock:
                self._queued -= 1
