"""`GradStream`: a gradient partition kept on the device, pulled down chunk by chunk while the host step runs.

With ``offload_optimizer.gradients_on_device`` (docs/offload.md) the host step asks for each chunk as it reaches it
(`fetch`); its copy down was queued `AHEAD` chunks earlier into one of `SLOTS` pinned slots, so it runs beside the
step of the chunk before (as ZeRO-Offload, Sec. 4.2, overlaps the parameters' swap-in). Where the kernel writes a
chunk's 16-bit parameters over its gradient in the slot, the slot's next copy down waits for their copy up
(`copy_up`). Host memory: `SLOTS` x chunk elements of the gradient's dtype. DeepSpeed has no counterpart: its
offloaded stages keep the gradient partition in host memory (``single_partition_of_fp32_groups[i].grad``).
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from zero_offload.offload.copies import DONE, CopyHandle, Copies

__all__ = ["GradStream", "SLOTS", "AHEAD"]

SLOTS, AHEAD = 3, 1        # AHEAD < SLOTS: a slot is refilled only once the kernel is done with its chunk


class GradStream:
    """The copies down of one host step's gradient chunks (see the module docstring).

    Args:
        copies: the copy engine (``host_empty`` pins the slots; ``to_host`` queues the copies down).
    """

    def __init__(self, copies: Copies):
        self.copies = copies
        # Made at the first step: the gradient's dtype, the largest chunk (``offload_optimizer.copy_chunk`` at most)
        self.slots: list[torch.Tensor] = []
        self.order: list[tuple[int, int, int]] = []
        self.grads: Sequence[torch.Tensor] = ()
        self.handles: list[CopyHandle | None] = []
        self.readers: list[threading.Event] = []       # per chunk: its copy up was queued (`copy_up`)
        self.reader_handles: list[CopyHandle | None] = []
        self.position: dict[tuple[int, int], int] = {}
        self.issued = 0
        self.over_slot: list[bool] = []
        self.copied_up = False

    def begin(self, grads: Sequence[torch.Tensor], outs: list[torch.Tensor | None],
              order: list[tuple[int, int, int]]) -> list[torch.Tensor | None]:
        """A host step over device ``grads`` (per group, 1-D) in chunk ``order`` ((group, lo, hi)) starts: the first
        chunks' copies down are queued. A group whose parameters the kernel would write over its gradient (``outs[g]
        is grads[g]``) writes them over each chunk's slot instead, copied up from there (`copy_up`): returns ``outs``
        with those groups' None (the kernel's ``outputs``; `fetch` gives it the slots)."""
        numel = max((hi - lo for _, lo, hi in order), default=1)
        dtype = grads[0].dtype
        if not self.slots or self.slots[0].dtype != dtype or self.slots[0].numel() < numel:
            self.slots = [self.copies.host_empty(numel, dtype) for _ in range(SLOTS)]
        self.over_slot = [out is not None and out is grad for out, grad in zip(outs, grads)]
        self.grads, self.order, self.copied_up = grads, order, any(self.over_slot)
        self.position = {(g, lo): k for k, (g, lo, _) in enumerate(order)}
        self.handles = [None] * len(order)
        self.readers = [threading.Event() for _ in order] if self.copied_up else []
        self.reader_handles = [None] * len(order)
        self.issued = 0
        self._issue_through(AHEAD)
        return [None if over else out for out, over in zip(outs, self.over_slot)]

    def fetch(self, g: int, _param: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`CPUAdam.step`'s ``fetch``: elements [lo, hi) of group ``g``'s gradient, landed in a pinned slot, and the
        slot again where the kernel writes the parameters over it (else None); queues the copies down of the
        chunks after it first.

        Raises:
            KeyError: [lo, ...) of group ``g`` is not a chunk of the order given to `begin`.
        """
        k = self.position[g, lo]
        self._issue_through(k + AHEAD)
        self.handles[k].synchronize()
        slot = self.slots[k % SLOTS][:hi - lo]
        return slot, (slot if self.over_slot[g] else None)

    def copy_up(self, dst: torch.Tensor, g: int, lo: int, after: CopyHandle | None) -> CopyHandle:
        """Queue the copy of the parameters the kernel wrote over the slot of the chunk at [lo, ...) of group ``g``
        into device ``dst`` (`Copies.to_device`'s ``after``); the slot's next copy down waits for it."""
        handle, k = DONE, None
        try:
            k = self.position[g, lo]
            handle = self.copies.to_device(dst, self.slots[k % SLOTS][:dst.numel()], after)
        finally:              # set even when this failed: the copies down never wait for it forever
            for i in ([k] if k is not None else range(len(self.readers))):
                if i == k or self.reader_handles[i] is None:
                    self.reader_handles[i] = handle
                self.readers[i].set()
        return handle

    def _issue_through(self, last: int) -> None:
        """Queue the copies down of the chunks up to ``last`` (an index into the order) not queued yet."""
        while self.issued <= min(last, len(self.order) - 1):
            k = self.issued
            g, lo, hi = self.order[k]
            if self.copied_up and k >= SLOTS:           # the slot's previous chunk is copied up from it first
                self.readers[k - SLOTS].wait()
                self.copies.downloads_after(self.reader_handles[k - SLOTS])
            self.handles[k] = self.copies.to_host(self.slots[k % SLOTS][:hi - lo], self.grads[g][lo:hi])
            self.issued += 1

    def finish(self) -> None:
        """The step is over (finished or failed): wait for the copies down still in flight, drop the references."""
        for handle in self.handles[:self.issued]:
            handle.synchronize()
        self.grads, self.handles = (), []

    def tensors(self) -> list[torch.Tensor]:
        """The pinned slots (memory accounting)."""
        return list(self.slots)
