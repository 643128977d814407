"""super_offload with the optimizer states on NVMe: each sub-group's host step runs during backward, exactly.

The in-memory speculative step (`zero_offload.zero.speculation`) steps each gradient piece as it lands into a
second bank of state. Swap files are read and written a sub-group at a time, so here the unit is the sub-group:
once every element of a sub-group's gradient is final (its copies down landed, or under accumulation its last
staged add ran), the host-step thread reads the sub-group's live state from its swap files into a pool buffer,
steps it there with the loss scale known and a clip coefficient of 1, writes the result into the *other* bank of
swap files, and lands the updated parameters in a landing buffer (`NvmeAdam`). The live files are never written
by a speculation, so when the boundary knows the global norm (`settle`):

- no clipping fired and no overflow: the sub-groups no piece completed are stepped the same way, every
  sub-group's bank bit flips (no copy) and the landing buffers are copied over the parameters: bitwise the plain
  step, the same kernel on the same inputs;
- clipping fired (another scale) or the gradient changed after its sub-group was stepped: what was speculated is
  dropped and the plain step runs from the live files with the true coefficient: bitwise the plain step;
- fp16 overflow (`discard`): dropped; nothing was stepped.

The error bound is 0 for every coefficient, as in memory. The price is a second set of swap files (12 bytes per
parameter of NVMe, ``speculative_state``) and the landing buffer (the partition again, where the parameters live).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from zero_offload.host_thread import HostThread
from zero_offload.offload import timeline
from zero_offload.offload.speculation_base import Speculation

__all__ = ["SubGroupSpeculation"]

StepUnit = Callable[[int, list, float], None]
"""``step_unit(k, pieces, grad_scale)``: sub-group ``k`` stepped from its live state into the other bank, from
``pieces`` [(offset in the partition, gradient values)] that cover it."""


class SubGroupSpeculation(Speculation):
    """The speculative half of a host step over sub-groups stepped whole (see the module docstring).

    Args:
        units: per sub-group, (param group, first element, end) in its group's partition.
        groups: the number of param groups.
        step_unit: steps one sub-group into the other bank (`StepUnit`); runs on ``thread`` during backward and on
            the caller's thread at `settle`.
        thread: the host-step thread (its owner's; not closed here).

    The timings (``hidden_s``, ``total_s``) and ``last`` are `Speculation`'s.
    """

    def __init__(self, units: list[tuple[int, int, int]], groups: int, step_unit: StepUnit, thread: HostThread):
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
        thread); each sub-group they complete is queued on the host-step thread. A range reported twice (the
        gradient changed after its step) invalidates the speculation."""
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
        """At the boundary, once the global norm is known: True when the speculated step stands (``grad_scale`` is
        the one speculated with, the learning rates are the same and no gradient changed after its sub-group was
        stepped); every sub-group not stepped yet is then stepped here from ``grads`` (the finished partitions),
        and the caller flips the banks. False: nothing live changed, and the caller steps with ``grad_scale``.

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
