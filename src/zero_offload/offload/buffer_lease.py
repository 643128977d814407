"""A gradient buffer lent to the delayed update's host step while the next backward copies into it.

With one gradient buffer per partition instead of two, the delayed update's host step (step t, in its thread) and
the next backward (step t+1, copying its reduced buckets down) share the buffer. The step walks the partition from
its end, the order backward fills it, and releases each chunk once the kernel has read its gradient and the copy up
of the parameters it wrote over it is queued; a copy down into [lo, hi) waits until [lo, end) is released and then
orders itself after that copy up. At the seed's 10B model this saves the spare partition: 2 bytes per parameter of
host memory (20.6 GB), which is what lets the delayed update fit a 128 GB host.

The training thread blocks only when backward overtakes the host step (a host step slower than the backward that
follows it); the delayed step's thread never waits for the training thread.
"""
from __future__ import annotations

import bisect
import threading

from zero_offload.offload import timeline
from zero_offload.offload.handles import DONE, CopyHandle

__all__ = ["BufferLease"]


class BufferLease:
    """Elements [free_from, numel) of a lent buffer are released; releases come in descending order.

    Args:
        numel: elements of the buffer.
    """

    def __init__(self, numel: int):
        self._cond = threading.Condition()
        self.free_from = numel
        # Per released chunk, in release order (so ascending in -lo, for `bisect`): -lo, the copy up that read it,
        # and the host op that released it in a timeline being recorded.
        self._neg_starts: list[int] = []
        self._readers: list[tuple[CopyHandle, int | None]] = []

    def release(self, lo: int, hi: int, reader: CopyHandle) -> None:
        """The host step is done with [lo, hi) once ``reader``'s copy has read it (called from its thread).

        Raises:
            RuntimeError: [lo, hi) does not end where the released part begins (not the descending walk).
        """
        with self._cond:
            if hi != self.free_from:
                raise RuntimeError(f"buffer lease: chunk [{lo}, {hi}) released out of order (released from "
                                   f"{self.free_from}); the delayed step walks the partition from its end")
            self.free_from = lo
            tl = timeline.current()
            self._neg_starts.append(-lo)
            self._readers.append((reader, tl.last_host_op() if tl is not None else None))
            self._cond.notify_all()

    def release_all(self) -> None:
        """The host step is over (finished or failed): every element is free, after the last reader."""
        with self._cond:
            self.free_from = 0
            self._cond.notify_all()

    @property
    def last_reader(self) -> CopyHandle:
        """The copy up of the last chunk released (they land in queue order), or DONE before any."""
        return self._readers[-1][0] if self._readers else DONE

    @property
    def released(self) -> bool:
        """Every element is free."""
        return self.free_from == 0

    def wait(self, lo: int) -> CopyHandle:
        """Block until [lo, numel) is released; returns the copy up a write there must follow: the one that read
        the chunk holding ``lo`` (copies up land in queue order, so every chunk above it has been read too), or
        the last one after `release_all`."""
        with self._cond:
            while self.free_from > lo:
                self._cond.wait()
            i = bisect.bisect_left(self._neg_starts, -lo)     # the chunk with the largest start <= lo
            if i == len(self._readers):                        # below every released chunk: after `release_all`
                return self.last_reader
            reader, host_op = self._readers[i]
            tl = timeline.current()
            if tl is not None:
                tl.host_wait(host_op)                          # the training thread waited for the step's release
            return reader
