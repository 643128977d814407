"""`CopiesUp`: the copies up a host step queues, chunk by chunk, from host buffers to the device.

Each is tracked for its own reader: who queues it (`issue`: one issuing thread, so that the driver, which holds
whoever queues a copy while its copy queue is full, never holds the kernel's thread; where the device is the host,
the caller's thread), which host buffer it still reads (`track`, `wait_reads`: before a host step rewrites a buffer
it waits for the last copy reading it, and only that one), and which the compute stream has not waited for
(`pending`, `release`). The copies share one stream and land in queue order: one wait covers the ones before.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from zero_offload.runtime.host_thread import HostThread
from zero_offload.offload import timeline
from zero_offload.offload.copies import CopyHandle, Copies

__all__ = ["CopiesUp", "storage_of"]


def storage_of(t) -> int:
    """The address of tensor ``t``'s storage, by which the copies' reads are tracked: views of one buffer share it."""
    return t.untyped_storage().data_ptr()


class CopiesUp:
    """The copies up of one partition optimizer (see the module docstring).

    Attributes:
        pending: handles of the copies up of updated parameters that the compute stream must wait for before it
            reads them (`release`), in queue order.
        issuer: the issuing thread, made on first use (None before, and where the device is the host).
    """

    def __init__(self, copies: Copies):
        self.copies = copies
        # Copies up that may still read a host buffer, in queue order: (handle, storage address of what they read;
        # 0 for a staging ring, whose slots wait for their own copies).
        self.in_flight: deque[tuple[CopyHandle, int]] = deque()
        self.pending: list[CopyHandle] = []
        self.issuer: HostThread | None = None

    def issue(self, copy: Callable[[int, int, int], None], g: int, lo: int, hi: int) -> None:
        """Run ``copy(g, lo, hi)`` (which queues chunk [lo, hi) of group ``g``) on the issuing thread, after the chunk
        it follows in a recorded timeline; here where copies are synchronous (a thread would only take cores)."""
        if self.copies.synchronous:
            copy(g, lo, hi)
            return
        if self.issuer is None:
            self.issuer = HostThread("copy-up-issuer", self.copies.device)
        tl = timeline.current()
        chunk = tl.last_host_op() if tl is not None else None

        def run() -> None:
            if tl is not None:
                tl.host_work("copy_issue", 0, after=[chunk])     # the copy follows its chunk, not the next one
            copy(g, lo, hi)
        self.issuer.submit(run)

    def join(self) -> None:
        """Wait until every copy handed to `issue` is queued (its handle known)."""
        if self.issuer is not None:
            self.issuer.join()

    def track(self, handle: CopyHandle, reads: int) -> None:
        """Remember a copy up that reads host storage ``reads`` until it lands (`wait_reads`)."""
        while self.in_flight and self.in_flight[0][0].query():     # landed: forget them (never blocks)
            self.in_flight.popleft()
        self.in_flight.append((handle, reads))

    def wait_reads(self, writes: set[int] | None = None) -> None:
        """Block until the last queued copy up reading any of ``writes`` (storage addresses about to be written;
        None: every buffer) has landed; the compute stream's waits are not touched (this may run on its thread)."""
        last = max((i for i, (_, reads) in enumerate(self.in_flight) if writes is None or reads in writes),
                   default=-1)
        if last >= 0:
            self.in_flight[last][0].synchronize()
            for _ in range(last + 1):
                self.in_flight.popleft()

    def release(self) -> None:
        """After a step queued its copies up: the compute stream waits for all of them, one wait on the last (the
        copies share one stream and land in queue order)."""
        if self.pending:
            self.pending[-1].wait_stream()
            self.pending.clear()

    def close(self) -> None:
        """End the issuing thread and let the copies in flight land."""
        if self.issuer is not None:
            self.issuer.close()
        self.wait_reads()
