"""A queued copy's handle and a copy engine's running counts: what `copies` and `simulated` both hand out."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TransferCounts", "CopyHandle", "DONE"]


@dataclass
class TransferCounts:
    """Running totals of one copy engine: bytes each way, and host waits on a copy's event."""
    bytes_down: int = 0
    bytes_up: int = 0
    host_syncs: int = 0


class CopyHandle:
    """One queued copy: an event on its copy stream (None when it completed synchronously), and the counts
    its engine keeps (a host wait on the event is counted there)."""

    __slots__ = ("event", "counts")

    def __init__(self, event=None, counts: TransferCounts | None = None):
        self.event, self.counts = event, counts

    def query(self) -> bool:
        """True when the copy has finished (never blocks)."""
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Block the host until the copy has finished (before the host reads or rewrites its host side)."""
        if self.event is not None:
            if self.counts is not None and not self.event.query():
                self.counts.host_syncs += 1
            self.event.synchronize()

    def wait_stream(self, stream=None) -> None:
        """Make ``stream`` (default: the current stream) wait for this copy only."""
        if self.event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.event)


DONE = CopyHandle()
