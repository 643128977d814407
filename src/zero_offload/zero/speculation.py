"""The speculative host step: each piece of the partition is stepped while backward still runs, exactly.

SuperOffload (Lian et al. 2025, arXiv 2509.21271, Sec. 4.3; DeepSpeed 0.18+'s ``offload_optimizer.super_offload``)
starts a sub-group's CPU Adam step as soon as its gradient is on the host, before the global norm is known, and
rolls it back with an inverse Adam step on fp16 overflow; under gradient clipping it does not speculate at all. The
inverse is not exact: it rebuilds the old moments from the new ones and the gradient, m = (m' - (1 - b1) g) / b1,
which cancels when the gradient dwarfs the moments' history, a relative error of about 2**-24 / c in m and
2**-24 / c**2 in v for a clip coefficient c (6e-4 in v at c = 0.01).

Here nothing is rebuilt. The speculative kernel reads the master weights and moments and writes its result into a
second bank of the same size (`fused_adam_step`'s ``sources``), so what it read stays as it was. When the boundary
knows the global norm (`settle`):

- no clipping fired and no overflow (the scale is the one speculated with): the banks swap, a pointer swap, no
  copy. The result is bitwise the plain step's: the same kernel on the same inputs.
- clipping fired (another scale): the second bank is dropped and the caller runs the plain step in place, on the
  untouched state, with the true coefficient: bitwise the plain step's.
- fp16 overflow (`discard`): the second bank is dropped; nothing was stepped.

So the error bound is 0 for every coefficient. The price is memory, not accuracy: one more copy of the master
weights and moments on the host, 12 bytes per parameter (8 with bf16 moments), counted by
``zero_offload.estimate.memory`` as ``speculative_state`` and shown by ``memory_breakdown()``; and under clipping
the speculated work is done again (the plain step's time, exposed, as without speculation).

The pieces run in the order their gradients land, on the partition optimizer's persistent host-step thread (the
delayed update's step runs there too: one thread for every host step beside training), pinned to the
``cpuadam_cores_perc`` share of the cores, each after its gradient copy's event (or the staged add that made it
final). DeepSpeed's SuperOffload asserts CUDA and stage 3; this runs wherever the host step does, at stages 2 and 3.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from zero_offload.host_thread import HostThread
from zero_offload.offload import timeline
from zero_offload.offload.copies import CopyHandle, Copies
from zero_offload.offload.speculation_base import FinalRanges, Speculation, aligned_pieces
from zero_offload.optim.cpu_adam import CPUAdam

__all__ = ["SpeculativeStep", "FinalRanges"]   # FinalRanges: `zero_offload.offload.speculation_base`



class SpeculativeStep(Speculation):
    """The speculative half of a host step over the partitions of a `CPUAdam` (see the module docstring).

    Args:
        optimizer: the host optimizer; one fp32 master partition per param group (its only parameter).
        copies: page-locks the second bank where the masters are page-locked (copies up read them).
        threads: the kernel's thread count beside training.
        thread: the host-step thread the pieces run on (its owner's; not closed here).
        chunk: elements per piece (a cancelled speculation stops within one piece).

    Attributes:
        outs: per group, a 16-bit host buffer each piece's updated parameters are also written to (rounded from
            the new master), or None; set by the owner.
        on_piece: called as ``on_piece(group, lo, hi)`` after each piece, on the thread that stepped it (the owner
            starts the piece's copy up into a landing buffer); None: nothing.
        (and `Speculation`'s: ``hidden_s``, ``total_s``, ``last``).
    """

    def __init__(self, optimizer: CPUAdam, copies: Copies, threads: int, thread: HostThread, chunk: int):
        super().__init__(thread, len(optimizer.param_groups))
        self.optimizer, self.copies, self.threads, self.chunk = optimizer, copies, threads, chunk
        self.banks: list[dict[str, torch.Tensor]] = []       # per group: master, exp_avg, exp_avg_sq
        self.outs: list[torch.Tensor | None] = [None] * len(optimizer.param_groups)
        self.on_piece: Callable[[int, int, int], None] | None = None

    @property
    def masters(self) -> list[torch.Tensor]:
        return [g["params"][0] for g in self.optimizer.param_groups]

    def begin(self, grad_scale: float) -> None:
        """The boundary micro-step starts: its pieces are stepped with ``grad_scale`` (1 / loss scale, clip
        coefficient 1) as they land. The learning rates are the param groups' now (the schedule steps after)."""
        self.join()
        if not self.banks:
            self._allocate()
        for master in self.masters:
            self.optimizer.ensure_state(master)
        self.grad_scale, self.active, self.valid, self.cancelled = grad_scale, True, True, False
        self.ranges = [[] for _ in self.masters]
        self.busy_s = 0.0

    def submit(self, g: int, lo: int, values: torch.Tensor, copy: CopyHandle | None) -> None:
        """Step group ``g``'s elements [lo, lo + len(values)) into the second bank once ``copy`` has landed (any
        thread). A range submitted twice (the gradient changed after its step) invalidates the speculation."""
        hi = lo + values.numel()
        with self.lock:
            if not self.claim(g, lo, hi):
                return
        tl = timeline.current()

        def run() -> None:
            if copy is not None:
                copy.synchronize()
            for start in range(0, hi - lo, self.chunk):
                if self.cancelled:
                    return
                end = min(hi - lo, start + self.chunk)
                self._step_piece(g, lo + start, lo + end, values[start:end], self.grad_scale)
                if tl is not None:
                    tl.host_work("host_step", end - start)
        self.thread.submit(run)


    def settle(self, grad_scale: float, grads: Sequence[torch.Tensor]) -> bool:
        """At the boundary, once the global norm is known: True when the speculated step stands (``grad_scale`` is
        the one speculated with and no gradient changed after its piece was stepped); the banks are then swapped
        and the step counted, every range no piece covered stepped first on this thread from ``grads`` (the
        finished partitions). False: nothing changed, and the caller steps in place with ``grad_scale``.

        Raises:
            HostThreadError: a speculative piece failed (chained to its exception).
        """
        if not self.stands(grad_scale):
            return False
        for g, grad in enumerate(grads):
            for lo, hi in _gaps(self.ranges[g], grad.numel()):
                self._step_piece(g, lo, hi, grad[lo:hi], grad_scale)
        self._swap_banks()
        for master in self.masters:
            self.optimizer.count_step(master)
        self.accepted()
        return True


    def bank_tensors(self) -> list[torch.Tensor]:
        """The second bank: one more master and both moments per group (memory accounting)."""
        return [t for bank in self.banks for t in bank.values()]

    def _allocate(self) -> None:
        for master in self.masters:
            state = self.optimizer.state.get(master) or {}
            dtype = state["exp_avg"].dtype if "exp_avg" in state else self.optimizer.state_dtype
            pinned = master.is_pinned()
            # Touched now (zeros), not by the first speculative piece: first-touch page faults cost ~1.5 s/GB.
            make = (lambda n, d: self.copies.host_empty(n, d).zero_()) if pinned else \
                (lambda n, d: torch.zeros(n, dtype=d))
            self.banks.append({"master": make(master.numel(), torch.float32),
                               "exp_avg": make(master.numel(), dtype), "exp_avg_sq": make(master.numel(), dtype)})

    def _step_piece(self, g: int, lo: int, hi: int, grad: torch.Tensor, grad_scale: float) -> None:
        """Group ``g``'s [lo, hi): read from the live state, written into the second bank (and ``outs``), then
        handed to ``on_piece``. The body starts on a 16-element boundary, so that the kernel's streaming stores
        (aligned only) cover all of it. Its kernel time counts in ``busy_s``."""
        began = time.perf_counter()
        out = self.outs[g]
        for a, b in aligned_pieces(lo, hi):
            self.optimizer.step_into(g, a, b, grad[a - lo:b - lo], grad_scale, self.banks[g], self.threads,
                                     out=None if out is None else out[a:b])
        self.busy_s += time.perf_counter() - began
        if self.on_piece is not None:
            self.on_piece(g, lo, hi)

    def _swap_banks(self) -> None:
        """The second bank becomes the live state (the tensors keep their identity: the optimizer's param groups
        and state are keyed by them); the old state becomes the next boundary's second bank."""
        for master, bank in zip(self.masters, self.banks):
            state = self.optimizer.state[master]
            for live, spare in ((master, bank["master"]), (state["exp_avg"], bank["exp_avg"]),
                                (state["exp_avg_sq"], bank["exp_avg_sq"])):
                _swap_storage(live, spare)


def _swap_storage(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the storages of two whole, contiguous tensors of one shape and dtype, in place."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    with torch.no_grad():
        a.set_(sb, 0, b.shape, b.stride())
        b.set_(sa, 0, a.shape, a.stride())


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
