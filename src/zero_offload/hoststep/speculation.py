"""The speculative host step of ``offload_optimizer.super_offload``: the boundary's step runs while backward does.

SuperOffload (Lian et al. 2025, arXiv 2509.21271, Sec. 4.3; DeepSpeed 0.18+'s ``offload_optimizer.super_offload``)
steps each sub-group on the CPU as soon as its gradient is on the host, before the global norm is known, and undoes
it with an inexact inverse Adam step. Here the speculative kernel writes a second bank and leaves what it read as it
was: at the boundary (`settle`) the speculated step stands, bitwise the plain step, or is dropped and the plain step
runs on the untouched state (docs/offload.md, "super_offload"; `zero_offload.hoststep.banks`).

Two units, one life cycle (`Speculation`), on the partition optimizer's host-step thread in the order the gradients
land: in host memory each gradient piece (`PieceSpeculation`); on NVMe each sub-group once all of its gradient is
final (`SubGroupSpeculation`).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Protocol, Sequence

import torch

from zero_offload.runtime.host_thread import HostThread
from zero_offload.hoststep.banks import Bank
from zero_offload.offload import timeline
from zero_offload.offload.copies import CopyHandle
from zero_offload.optim.cpu_adam import CPUAdam

__all__ = ["FinalRanges", "Speculation", "PieceSpeculation", "SubGroupSpeculation", "ALIGN", "aligned_pieces"]

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

    def invalidate(self) -> None:
        """The partition changed after it reported ranges (another backward before the step)."""


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
        self.busy_s = self.hidden_s = self.total_s = self._hidden = 0.0
        self.last = ""

    def sinks(self) -> list[GroupRanges]:
        """One `FinalRanges` per param group, for its gradient partition."""
        return [GroupRanges(self, g) for g in range(self.groups)]

    def submit(self, g: int, lo: int, values: torch.Tensor, copy: CopyHandle | None) -> None:
        raise NotImplementedError

    def claim(self, g: int, lo: int, hi: int) -> bool:
        """Record group ``g``'s final range [lo, hi) for this boundary (holding ``lock``): False when no speculation
        is under way, or when the range was reported before (the speculation is then invalid)."""
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
        is the one speculated with, no gradient changed after its step, and ``also``); if not, the work still
        queued is cancelled. Either way the thread is joined and the boundary ends.

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


class PieceSpeculation(Speculation):
    """The speculative half of a host step over the partitions of a `CPUAdam` in host memory, piece by piece.

    Args:
        optimizer: the host optimizer; one fp32 master partition per param group (its only parameter).
        bank: where the pieces are written, and how the boundary keeps or drops them (`zero_offload.hoststep.banks`).
        threads: the kernel's thread count beside training.
        thread: the host-step thread the pieces run on (its owner's; not closed here).
        chunk: elements per piece (a cancelled speculation stops within one piece).

    Attributes:
        outs: per group, a 16-bit host buffer the bank's size each piece's updated parameters are also written to
            (rounded from the new master, at the bank's offset), or None; set by the owner.
        on_piece: None, or called as ``on_piece(group, lo, hi, source)`` after each piece, on the thread that
            stepped it, with where its parameters are read from (its 16-bit output or the master; None: to be
            rounded from the live master); set by the owner.
    """

    def __init__(self, optimizer: CPUAdam, bank: Bank, threads: int, thread: HostThread, chunk: int):
        super().__init__(thread, len(optimizer.param_groups))
        self.optimizer, self.bank, self.threads, self.chunk = optimizer, bank, threads, chunk
        self.outs: list[torch.Tensor | None] = [None] * len(optimizer.param_groups)
        self.on_piece: Callable[[int, int, int, torch.Tensor | None], None] | None = None

    @property
    def masters(self) -> list[torch.Tensor]:
        return [g["params"][0] for g in self.optimizer.param_groups]

    def begin(self, grad_scale: float) -> None:
        """The boundary micro-step starts: its pieces are stepped with ``grad_scale`` as they land, at the param
        groups' learning rates now (the schedule steps after)."""
        self.join()
        for master in self.masters:
            self.optimizer.ensure_state(master)
        self.bank.begin()
        self.grad_scale, self.active, self.valid, self.cancelled = grad_scale, True, True, False
        self.ranges = [[] for _ in self.masters]
        self.busy_s = 0.0

    def submit(self, g: int, lo: int, values: torch.Tensor, copy: CopyHandle | None) -> None:
        """Step group ``g``'s elements [lo, lo + len(values)) -- as many as the bank takes, the rest wait for the
        boundary -- once ``copy`` has landed (any thread; a range submitted twice invalidates the speculation)."""
        with self.lock:
            if not self.claim(g, lo, lo + values.numel()):
                return
            hi = lo + self.bank.reserve(g, values.numel())
            self.ranges[g].pop()                 # only what the bank took counts as stepped
            if hi == lo:
                return
            self.ranges[g].append((lo, hi))
        tl = timeline.current()

        def run() -> None:
            if copy is not None:
                copy.synchronize()
            for start in range(0, hi - lo, self.chunk):
                if self.cancelled:
                    return
                end = min(hi - lo, start + self.chunk)
                at = self.bank.save(g, lo + start, lo + end)
                if self.bank.copies_out and tl is not None:
                    tl.host_work("host_save", end - start)
                self._step_piece(g, lo + start, lo + end, values[start:end], self.grad_scale, at)
                if tl is not None:
                    tl.host_work("host_step", end - start)
        self.thread.submit(run)

    def settle(self, grad_scale: float, grads: Sequence[torch.Tensor]) -> bool:
        """At the boundary, once the global norm is known: True when the speculated step stands (`stands`); every
        range no piece covered is then stepped on this thread from ``grads`` (the finished partitions), the bank
        kept and the step counted. False: the live state is what it was, and the caller steps with ``grad_scale``.

        Raises:
            HostThreadError: a speculative piece failed (chained to its exception).
        """
        if not self.stands(grad_scale):
            self.bank.drop()
            return False
        tl = timeline.current()
        for g, grad in enumerate(grads):
            for lo, hi in _gaps(self.ranges[g], grad.numel()):
                for a in range(lo, hi, self.chunk):      # chunk by chunk: each one's copy up starts at once
                    b = min(hi, a + self.chunk)
                    self._step_piece(g, a, b, grad[a:b], grad_scale, self.bank.final_offset(g, a))
                    if tl is not None:
                        tl.host_work("host_step", b - a)
        self.bank.keep()
        for master in self.masters:
            self.optimizer.count_step(master)
        self.accepted()
        return True

    def discard(self) -> None:
        """fp16 overflow (or a checkpoint load): what was speculated is dropped, the live state as it was."""
        if self.active:
            super().discard()
            self.bank.drop()

    def result(self, g: int) -> torch.Tensor:
        """Group ``g``'s master as the speculated step writes it (the bank's, or the live one stepped in place)."""
        return self.bank.target(g)["master"]

    def _step_piece(self, g: int, lo: int, hi: int, grad: torch.Tensor, grad_scale: float,
                    at: int | None) -> None:
        """Group ``g``'s [lo, hi) from the live state into the bank's target (and ``outs`` from offset ``at``; None:
        not there) as `aligned_pieces`, then handed to ``on_piece``; its time counts in ``busy_s``."""
        began = time.perf_counter()
        into = self.bank.target(g)
        out = None if self.outs[g] is None or at is None else self.outs[g][at:at + hi - lo]
        for a, b in aligned_pieces(lo, hi):
            self.optimizer.step_into(g, a, b, grad[a - lo:b - lo], grad_scale, into, self.threads,
                                     out=None if out is None else out[a - lo:b - lo])
        self.busy_s += time.perf_counter() - began
        if self.on_piece is not None:
            own = self.outs[g] is None        # parameters of the master's dtype go up from the master
            self.on_piece(g, lo, hi, self.result(g)[lo:hi] if own else out)


def _gaps(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The parts of [0, n) that no range covers."""
    out, at = [], 0
    for lo, hi in sorted(ranges):
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < n:
        out.append((at, n))
    return out


class SubGroupSpeculation(Speculation):
    """The speculative half of a host step over sub-groups stepped whole (see the module docstring).

    Args:
        units: per sub-group, (param group, first element, end) in its group's partition.
        groups: the number of param groups.
        step_unit: ``step_unit(k, pieces, grad_scale)`` steps sub-group ``k`` from its live state into the other
            bank, from ``pieces`` [(offset in the partition, gradient values)] that cover it; runs on ``thread``
            during backward and on the caller's thread at `settle`.
        thread: the host-step thread (its owner's; not closed here).
    """

    def __init__(self, units: list[tuple[int, int, int]], groups: int, step_unit: Callable[[int, list, float], None],
                 thread: HostThread):
        super().__init__(thread, groups)
        self.units, self.step_unit = units, step_unit
        self.by_group = [[k for k, u in enumerate(units) if u[0] == g] for g in range(groups)]
        self.pieces: list[list] = [[] for _ in units]
        self.covered = [0] * len(units)
        self.stepped: set[int] = set()

    def begin(self, grad_scale: float) -> None:
        """The boundary micro-step starts: its sub-groups are stepped with ``grad_scale`` as they become final."""
        self.join()
        self.grad_scale, self.active, self.valid, self.cancelled = grad_scale, True, True, False
        self.ranges = [[] for _ in range(self.groups)]
        self.pieces = [[] for _ in self.units]
        self.covered = [0] * len(self.units)
        self.stepped = set()
        self.busy_s = 0.0

    def submit(self, g: int, lo: int, values: torch.Tensor, copy) -> None:
        """Group ``g``'s elements [lo, lo + len(values)) are final once ``copy`` (None: already) has landed (any
        thread); each sub-group they complete is queued on the host-step thread (see `PieceSpeculation.submit`)."""
        hi = lo + values.numel()
        complete = []
        with self.lock:
            if not self.claim(g, lo, hi):
                return
            for k in self.by_group[g]:
                _, u_lo, u_hi = self.units[k]
                a, b = max(lo, u_lo), min(hi, u_hi)
                if a < b:
                    self.pieces[k].append((a, values[a - lo:b - lo], copy))
                    self.covered[k] += b - a
                    if self.covered[k] == u_hi - u_lo:
                        complete.append(k)
        tl = timeline.current()
        for k in complete:
            self.thread.submit(lambda k=k: self._run(k, tl))

    def _run(self, k: int, tl) -> None:
        if self.cancelled:
            return
        for _, _, copy in self.pieces[k]:
            if copy is not None:
                copy.synchronize()
        began = time.perf_counter()
        self.step_unit(k, [(a, v) for a, v, _ in self.pieces[k]], self.grad_scale)
        self.busy_s += time.perf_counter() - began
        self.stepped.add(k)
        if tl is not None:
            _, lo, hi = self.units[k]
            tl.host_work("host_step", hi - lo)

    def settle(self, grad_scale: float, grads: Sequence[torch.Tensor], same_lrs: bool = True) -> bool:
        """At the boundary, once the global norm is known: True when the speculated step stands (`stands`, with
        ``same_lrs``); every sub-group not stepped yet is then stepped here from ``grads`` (the finished
        partitions), and the caller flips the banks. False: nothing live changed; the caller steps.

        Raises:
            HostThreadError: a speculated sub-group failed (chained to its exception).
        """
        if not self.stands(grad_scale, same_lrs):
            return False
        for k, (g, lo, hi) in enumerate(self.units):
            if k not in self.stepped:
                began = time.perf_counter()
                self.step_unit(k, [(lo, grads[g][lo:hi])], grad_scale)
                self.busy_s += time.perf_counter() - began
        self.accepted()
        return True
