"""Where ``super_offload``'s speculated pieces are written in host memory, and how the boundary keeps or drops them
(`zero_offload.hoststep.speculation.PieceSpeculation` holds one `Bank`); ``super_offload_fraction`` chooses:

- `SwapBank` (fraction 1): a second bank of master weights and moments, the size of the live state. The kernel
  reads the live state and writes the bank; a step that stands swaps the two (a pointer swap, no copy).
- `UndoBank` (fraction < 1): the first-landing share of each partition is stepped in place, each piece copied out
  first into an undo bank of that share's size; a step that does not stand copies them back.

Either way the live state after the boundary is bitwise the plain step's, or (dropped) what it was (the memory and
host work of each: docs/offload.md).
"""
from __future__ import annotations

from typing import Protocol

import torch

from zero_offload.offload.copies import Copies
from zero_offload.optim.cpu_adam import CPUAdam

__all__ = ["Bank", "SwapBank", "UndoBank", "speculated_numel"]

STATE = ("master", "exp_avg", "exp_avg_sq")


def speculated_numel(numel: int, fraction: float) -> int:
    """Elements of a partition of ``numel`` that ``super_offload_fraction`` = ``fraction`` speculates (the undo
    bank's size; `zero_offload.estimate.memory` counts the same)."""
    return numel if fraction >= 1.0 else int(numel * fraction)


class Bank(Protocol):
    """Where a `PieceSpeculation` writes, per param group ``g`` (one 1-D master partition each).

    Attributes:
        copies_out: `save` copies the live state out (the host work it adds is recorded as ``host_save``).
    """
    copies_out: bool

    def begin(self) -> None:
        """A boundary starts (the optimizer's state exists)."""

    def reserve(self, g: int, n: int) -> int:
        """How many of the next ``n`` final elements of group ``g`` may be speculated this boundary (taken)."""

    def save(self, g: int, lo: int, hi: int) -> int:
        """Group ``g``'s [lo, hi) is about to be speculated into `target` (on the host-step thread): copied out
        where the bank undoes; returns the range's offset in bank-sized buffers (the pieces' 16-bit outputs)."""

    def final_offset(self, g: int, lo: int) -> int | None:
        """Where a range from ``lo`` stepped at the boundary (not speculated) writes its 16-bit output in
        bank-sized buffers; None: nowhere (the owner rounds it from the master)."""

    def target(self, g: int) -> dict[str, torch.Tensor]:
        """Group ``g``'s ``master``, ``exp_avg`` and ``exp_avg_sq`` the speculated step writes (1-D, whole)."""

    def keep(self) -> None:
        """The speculated step stands: its results become the live state."""

    def drop(self) -> None:
        """It does not: the live state is again what it was at `begin`."""

    def tensors(self) -> list[torch.Tensor]:
        """The bank's own tensors (memory accounting; copies up may read a swap bank)."""


def _live(optimizer: CPUAdam, g: int) -> dict[str, torch.Tensor]:
    master = optimizer.param_groups[g]["params"][0]
    state = optimizer.state[master]
    return {"master": master, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


def _allocate(optimizer: CPUAdam, numels: list[int], pinned_like: bool, copies: Copies) -> list[dict]:
    """Per group: a master (fp32) and both moments (the state's dtype) of ``numels[g]`` elements, zero-filled now:
    first-touch page faults during the step cost ~1.5 s/GB. Page-locked where ``pinned_like`` and the master is."""
    banks = []
    for g, n in enumerate(numels):
        live = _live(optimizer, g)
        pinned = pinned_like and live["master"].is_pinned()
        make = (lambda k, d: copies.host_empty(k, d).zero_()) if pinned else (lambda k, d: torch.zeros(k, dtype=d))
        banks.append({name: make(n, live[name].dtype) for name in STATE})
    return banks


class SwapBank:
    """A second bank the size of the live state, swapped with it when the step stands (see the module docstring).
    Page-locked where the masters are: a swapped-in master is copied up."""

    copies_out = False

    def __init__(self, optimizer: CPUAdam, copies: Copies):
        self.optimizer, self.copies = optimizer, copies
        self.banks: list[dict[str, torch.Tensor]] = []

    def begin(self) -> None:
        if not self.banks:
            numels = [g["params"][0].numel() for g in self.optimizer.param_groups]
            self.banks = _allocate(self.optimizer, numels, True, self.copies)

    def reserve(self, g: int, n: int) -> int:
        return n

    def save(self, g: int, lo: int, hi: int) -> int:
        return lo                           # the live state is only read

    def final_offset(self, g: int, lo: int) -> int | None:
        return lo

    def target(self, g: int) -> dict[str, torch.Tensor]:
        return self.banks[g]

    def keep(self) -> None:
        """The bank becomes the live state; the tensors keep their identity (the optimizer's param groups and
        state are keyed by them), and the old state becomes the next boundary's bank."""
        for g, bank in enumerate(self.banks):
            live = _live(self.optimizer, g)
            for name in STATE:
                _swap_storage(live[name], bank[name])

    def drop(self) -> None:
        pass                                # nothing live was written

    def tensors(self) -> list[torch.Tensor]:
        return [t for bank in self.banks for t in bank.values()]


class UndoBank:
    """The live state stepped in place, the speculated share's old values kept in an undo bank (see the module
    docstring). ``fraction``: the share of each group's partition speculated, the first elements to land."""

    copies_out = True

    def __init__(self, optimizer: CPUAdam, fraction: float):
        self.optimizer, self.fraction = optimizer, fraction
        self.banks: list[dict[str, torch.Tensor]] = []
        self.free: list[int] = []                            # per group: elements not yet reserved
        self.saved: list[tuple[int, int, int, int]] = []     # (group, lo, hi, offset in its bank)
        self.used: list[int] = []                            # per group: bank elements holding saved values

    def begin(self) -> None:
        if not self.banks:
            numels = [speculated_numel(g["params"][0].numel(), self.fraction) for g in self.optimizer.param_groups]
            self.banks = _allocate(self.optimizer, numels, False, None)
        self.free = [bank["master"].numel() for bank in self.banks]
        self.used = [0] * len(self.banks)
        self.saved = []

    def reserve(self, g: int, n: int) -> int:
        take = min(n, self.free[g])
        self.free[g] -= take
        return take

    def save(self, g: int, lo: int, hi: int) -> int:
        at, live, bank = self.used[g], _live(self.optimizer, g), self.banks[g]
        for name in STATE:
            bank[name][at:at + hi - lo].copy_(live[name][lo:hi])
        self.used[g] = at + hi - lo
        self.saved.append((g, lo, hi, at))
        return at

    def final_offset(self, g: int, lo: int) -> int | None:
        return None                         # stepped in place, its 16 bits rounded from the master

    def target(self, g: int) -> dict[str, torch.Tensor]:
        return _live(self.optimizer, g)

    def keep(self) -> None:
        self.saved = []

    def drop(self) -> None:
        for g, lo, hi, at in self.saved:
            live, bank = _live(self.optimizer, g), self.banks[g]
            for name in STATE:
                live[name][lo:hi].copy_(bank[name][at:at + hi - lo])
        self.saved = []

    def tensors(self) -> list[torch.Tensor]:
        return [t for bank in self.banks for t in bank.values()]


def _swap_storage(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the storages of two whole, contiguous tensors of one shape and dtype, in place."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    with torch.no_grad():
        a.set_(sb, 0, b.shape, b.stride())
        b.set_(sa, 0, a.shape, a.stride())
