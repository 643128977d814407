"""What the two speculative host steps share (super_offload: `zero_offload.zero.speculation` over states in host
memory, `zero_offload.nvme.speculation` over swap files): where a gradient partition reports the ranges of the
boundary micro-step that are final, and the life cycle of a speculation on its owner's host-step thread."""
from __future__ import annotations

import threading
from typing import Protocol

import torch

from zero_offload.host_thread import HostThread
from zero_offload.offload import timeline
from zero_offload.offload.copies import CopyHandle

__all__ = ["FinalRanges", "GroupRanges", "Speculation", "ALIGN", "aligned_pieces"]

ALIGN = 16    # elements: 64 bytes of fp32 master, 32 of bf16 moments (the kernel's streaming stores need both)


def aligned_pieces(lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) as a head up to the next multiple of `ALIGN` and a body from there (empty ones left out): the fused
    kernel's streaming stores are aligned only, so a speculated range is stepped as these two calls."""
    cut = min(hi, -(-lo // ALIGN) * ALIGN)
    return [(a, b) for a, b in ((lo, cut), (cut, hi)) if a < b]


class FinalRanges(Protocol):
    """Where a gradient partition reports the ranges of its boundary micro-step that are final (`GradPartition`)."""

    def landed(self, offset: int, values: torch.Tensor, copy: CopyHandle | None) -> None:
        """Elements [offset, offset + len(values)) of the partition are final once ``copy`` (None: already) has
        landed; ``values`` is the partition's view of them."""
        ...

    def invalidate(self) -> None:
        """The partition changed after it reported ranges (another backward before the step)."""
        ...


class GroupRanges:
    """`FinalRanges` of one param group: forwards to its `Speculation`'s ``submit(group, offset, values, copy)``."""

    def __init__(self, owner: "Speculation", group: int):
        self.owner, self.group = owner, group

    def landed(self, offset: int, values: torch.Tensor, copy: CopyHandle | None) -> None:
        self.owner.submit(self.group, offset, values, copy)

    def invalidate(self) -> None:
        self.owner.invalidate()


class Speculation:
    """The life cycle both speculative steps share: ``active`` from ``begin`` to settle or `discard`, ``valid`` until
    a gradient changes after its step (`invalidate`), ``cancelled`` to stop the work still queued on ``thread``
    (the owner's host-step thread, closed by the owner). Subclasses define ``submit`` and ``settle``.

    Attributes:
        grad_scale: the gradient scale the boundary's pieces are stepped with (1 / loss scale, clip coefficient 1).
        busy_s: seconds of speculated step time so far this boundary (added to by the subclass).
        hidden_s: seconds of speculated step time that ran before the boundary step began (during backward).
        total_s: seconds of step time of the last boundary's speculated step (what settle stepped included).
        last: "accepted", "redone" or "discarded": what the last boundary did with the speculated step.
    """

    def __init__(self, thread: HostThread, groups: int):
        self.thread, self.groups = thread, groups
        self.lock = threading.Lock()
        self.active = False
        self.valid = True
        self.cancelled = False
        self.grad_scale = 1.0
        self.ranges: list[list[tuple[int, int]]] = [[] for _ in range(groups)]   # per group: claimed [lo, hi)
        self.busy_s = self.hidden_s = self.total_s = 0.0
        self._hidden = 0.0
        self.last = ""

    def sinks(self) -> list[GroupRanges]:
        """One `FinalRanges` per param group, for its gradient partition."""
        return [GroupRanges(self, g) for g in range(self.groups)]

    def submit(self, g: int, lo: int, values: torch.Tensor, copy: CopyHandle | None) -> None:
        raise NotImplementedError

    def claim(self, g: int, lo: int, hi: int) -> bool:
        """Record group ``g``'s final range [lo, hi) for this boundary (call holding ``lock``): False when no
        speculation is under way, or when the range was reported before (the gradient changed after its step:
        the speculation is invalid from then on)."""
        if not self.active or not self.valid:
            return False
        if any(a < hi and lo < b for a, b in self.ranges[g]):
            self.valid = False
            return False
        self.ranges[g].append((lo, hi))
        return True

    def invalidate(self) -> None:
        """The gradients changed after they were stepped: the boundary redoes the step."""
        with self.lock:
            self.valid = False

    def stands(self, grad_scale: float, also: bool = True) -> bool:
        """The boundary's verdict, once the global norm is known: whether the speculated step stands (``grad_scale``
        is the one speculated with, no gradient changed after its step, and ``also``). The work still queued is
        cancelled where it does not; either way the thread is joined and the boundary ends. Then the subclass
        steps what no piece covered and calls `accepted`, or the caller runs the plain step.

        Raises:
            HostThreadError: a speculated piece failed (chained to its exception).
        """
        self._hidden = self.busy_s
        keep = self.active and self.valid and also and grad_scale == self.grad_scale
        if not keep:
            self.cancelled = True
        self.join()
        self.active = False
        if not keep:
            self.hidden_s = self.total_s = 0.0
            self.last = "redone"
        return keep

    def accepted(self) -> None:
        """The speculated step stood: record its hidden and total time."""
        self.hidden_s, self.total_s = self._hidden, self.busy_s
        self.last = "accepted"

    def discard(self) -> None:
        """fp16 overflow: what was speculated is dropped (no step is counted, nothing live was written)."""
        if self.active:
            self.cancelled = True
            self.join()
            self.active = False
            self.last = "discarded"

    def join(self) -> None:
        """Wait for the work queued on the host-step thread (re-raises its first failure)."""
        self.thread.join()
        tl = timeline.current()
        if tl is not None:
            tl.joined(self.thread.name)

    def close(self) -> None:
        """Stop the work still queued (before the owner closes the thread)."""
        self.cancelled = True
