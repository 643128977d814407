"""`MuonOwners`: each Muon matrix orthogonalized once, whole, on one owner rank, and its partitions sent back.

Newton-Schulz needs the whole matrix, while ZeRO keeps each rank's partition of it. Per round of matrices: (1) up,
each rank sends the owner of each matrix its pieces of the update (fp32, one all-to-all; none at stage 0, where the
owner holds them); (2) the owner assembles each matrix it owns on the compute device and orthogonalizes it
(`zero_offload.optim.muon.orthogonalize`); (3) down, the owner sends each rank its pieces of the result in the
iteration's dtype, exact there (one all-to-all).

Owners are chosen once (`assign_owners`), each matrix where most of it lies unless that breaks the balance of
Newton-Schulz FLOPs (torchtitan's DistMuon gives each matrix one rank too, by balance alone); a round in which no
piece lies off its owner runs no collective. The bytes this moves per Muon parameter: docs/muon.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from zero_offload.optim.muon import MuonRule, ns_dtype, ns_flops, orthogonalize
from zero_offload.zero.layout import GroupLayout, Piece

__all__ = ["MuonMatrix", "MuonOwners", "RoundWindows", "assign_owners", "assembled_bytes", "window_bytes",
           "ROUND_NUMEL", "ASSEMBLED_FORMULA", "WINDOW_FORMULA"]

ROUND_NUMEL = 1 << 27       # elements of the matrices exchanged per round
BALANCE_SLACK = 0.05        # how far past an even share of the FLOPs a rank may go to own a matrix it holds
ASSEMBLED_FORMULA = ("Muon: min(round = 2^27, Muon elements) x 20 B on the device (pieces received and assembled in "
                     "fp32, up to three iteration temporaries), an upper bound of an owner's working memory")
WINDOW_FORMULA = ("Muon: min(round = 2^27, this rank's Muon elements) x 8 B where the optimizer state lives (the "
                  "largest round's updates and orthogonalized results, fp32, held from initialize: RoundWindows), "
                  "an upper bound")

AllToAll = Callable[[torch.Tensor, torch.Tensor, list, list], None]   # (out, inp, out_splits, in_splits)


@dataclass(frozen=True)
class MuonMatrix:
    """One Muon matrix: group ``group``'s parameter ``name`` of ``shape``, its ``pieces`` across the ranks'
    partitions, orthogonalized by ``owner``."""
    group: int
    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    owner: int
    num_heads: int | None = None

    @property
    def numel(self) -> int:
        return sum(p.length for p in self.pieces)


def assembled_bytes(muon_numel: int, round_numel: int = ROUND_NUMEL) -> int:
    """Upper bound of the device bytes an owner works in during one round (`ASSEMBLED_FORMULA`), for the estimate."""
    return min(round_numel, muon_numel) * 20


def window_bytes(part_numel: int, round_numel: int = ROUND_NUMEL) -> int:
    """Upper bound of the bytes a rank's Muon step works in beside its states (`WINDOW_FORMULA`), for the
    estimate: ``part_numel`` is this rank's Muon partition."""
    return min(round_numel, part_numel) * 8


def assign_owners(shapes: Sequence[tuple[int, ...]], world: int,
                  local: Sequence[Sequence[int]] | None = None) -> list[int]:
    """Per matrix, its owner rank, the same on every rank: the largest Newton-Schulz cost first, each to the rank
    that holds most of it (``local[i][r]``: elements of matrix i in rank r's partition; None at stage 0) while that
    rank's FLOPs stay within ``1 + BALANCE_SLACK`` of an even share, else to the rank with the least so far (ties:
    the lower rank, then the earlier matrix)."""
    costs = [ns_flops(s) for s in shapes]
    cap = sum(costs) / world * (1 + BALANCE_SLACK)
    load = [0.0] * world
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        held = local[i] if local is not None else [0] * world
        rank = next((r for r in sorted(range(world), key=lambda r: (-held[r], load[r], r))
                     if load[r] + costs[i] <= cap), min(range(world), key=lambda r: (load[r], r)))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


class RoundWindows:
    """A Muon step's working memory, at most `window_bytes`: per round, each Muon group's updates and orthogonalized
    results as views of two fp32 buffers sized once for the largest round's `MuonOwners.spans` and reused (fresh
    buffers would cost more than the passes over them: their pages are faulted in each time)."""

    def __init__(self, owners: "MuonOwners", device: torch.device):
        largest = max((sum(hi - lo for lo, hi in owners.spans(i).values()) for i in range(len(owners.rounds))),
                      default=0)
        self.updates = torch.empty(largest, dtype=torch.float32, device=device)
        self.results = torch.empty(largest, dtype=torch.float32, device=device)

    def views(self, spans: dict[int, tuple[int, int]]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """For one round's ``spans``: per group, its updates (to be written) and its results (zeros)."""
        updates, results, at = {}, {}, 0
        for g, (lo, hi) in spans.items():
            updates[g] = self.updates[at:at + hi - lo]
            results[g] = self.results[at:at + hi - lo].zero_()
            at += hi - lo
        return updates, results


@dataclass(frozen=True)
class _Exchange:
    """One all-to-all of a round, fixed by the layout: the (key, offset, length) pieces this rank sends and where
    those it receives go, in order, the elements to and from each rank, and whether any piece crosses to another
    rank (if none, every rank knows it and copies its own pieces without the collective)."""
    send: tuple[tuple, ...]
    in_splits: list[int]
    out_splits: list[int]
    recv: tuple[tuple, ...]
    crossing: bool = True


class MuonOwners:
    """The owners of a partition optimizer's Muon matrices and the exchanges of one step (module docstring).

    Args:
        layouts: per param group, where each parameter's elements sit in the ranks' partitions
            (`zero_offload.zero.layout`).
        rules: per param group, its `MuonRule`, or None for a group stepped by Adam.
        heads: per param group, {parameter name: attention heads} for DeepSpeed's ``per_head_muon``.
        rank, world: this rank and the data-parallel world size.
        replicated: every rank holds every partition (stage 0).
        all_to_all: the group's all-to-all (`zero_offload.comm.DistContext.all_to_all`).
        device: where the matrices are assembled and orthogonalized (the compute device).
        round_numel: elements of the matrices exchanged per round (at least one whole matrix; default
            ``ROUND_NUMEL``), which bounds an owner's assembled matrices and the step's working memory.

    Attributes:
        matrices: every Muon matrix with its owner, in group and layout order (and ``rules``, as given).
    """

    def __init__(self, layouts: Sequence[GroupLayout], rules: Sequence[MuonRule | None],
                 heads: Sequence[dict[str, int]], rank: int, world: int, replicated: bool, all_to_all: AllToAll,
                 device: torch.device, round_numel: int | None = None):
        found = [(g, p) for g, (lay, rule) in enumerate(zip(layouts, rules)) if rule is not None for p in lay.params]
        local = None if replicated else [[sum(x.length for x in p.pieces if x.rank == r) for r in range(world)]
                                         for _, p in found]
        owners = assign_owners([p.shape for _, p in found], world, local)
        self.matrices = [MuonMatrix(g, p.name, p.shape, p.pieces, o, heads[g].get(p.name))
                         for (g, p), o in zip(found, owners)]
        self.rules, self.rank, self.world = list(rules), rank, world
        self.replicated, self.all_to_all, self.device = replicated, all_to_all, device
        dtypes = {ns_dtype(r, device) for r in rules if r is not None}
        self.down_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        round_numel = ROUND_NUMEL if round_numel is None else round_numel
        rounds: list[list[MuonMatrix]] = []
        for m in self.matrices:
            if not rounds or sum(x.numel for x in rounds[-1]) + m.numel > round_numel:
                rounds.append([])
            rounds[-1].append(m)
        # The layout fixes both exchanges of every round: planned once, replayed each step.
        self.rounds = [(r, self._up(r), self._down(r)) for r in rounds]
        self._spans = [self._held_ranges(r) for r in rounds]

    def _crossing(self, matrices: list[MuonMatrix]) -> bool:
        """Whether any piece of ``matrices`` lies outside its owner's partition (the same answer on every rank)."""
        return any(p.rank != m.owner for m in matrices for p in m.pieces)

    def held(self, m: MuonMatrix, rank: int) -> list[Piece]:
        """The pieces of ``m`` in ``rank``'s partition (every piece at stage 0)."""
        return list(m.pieces) if self.replicated else [p for p in m.pieces if p.rank == rank]

    def _up(self, matrices: list[MuonMatrix]) -> _Exchange:
        """Step 1's exchange: this rank's pieces of each owner's matrices, keyed by group and partition offset;
        received pieces keyed by matrix name and offset in it (stage 0: nothing moves, the owner holds them)."""
        mine = [m for m in matrices if m.owner == self.rank]
        if self.replicated:
            return _Exchange((), [0] * self.world, [0] * self.world, (), False)
        send = [[(m.group, p.part_offset, p.length)
                 for m in matrices if m.owner == dst for p in self.held(m, self.rank)] for dst in range(self.world)]
        recv = [[(m.name, p.param_offset, p.length) for m in mine for p in self.held(m, src)]
                for src in range(self.world)]
        return _Exchange(tuple(x for s in send for x in s), [sum(x[2] for x in s) for s in send],
                         [sum(x[2] for x in r) for r in recv], tuple(x for r in recv for x in r),
                         self._crossing(matrices))

    def _down(self, matrices: list[MuonMatrix]) -> _Exchange:
        """Step 3's exchange: each rank's pieces of this rank's results, keyed by matrix name and offset in it;
        received pieces keyed by group and partition offset."""
        send = [[(m.name, p.param_offset, p.length)
                 for m in matrices if m.owner == self.rank for p in self.held(m, dst)] for dst in range(self.world)]
        recv = [[(m.group, p.part_offset, p.length)
                 for m in matrices if m.owner == src for p in self.held(m, self.rank)] for src in range(self.world)]
        return _Exchange(tuple(x for s in send for x in s), [sum(x[2] for x in s) for s in send],
                         [sum(x[2] for x in r) for r in recv], tuple(x for r in recv for x in r),
                         self.replicated or self._crossing(matrices))

    def spans(self, i: int) -> dict[int, tuple[int, int]]:
        """Round ``i``: per Muon group, the elements [lo, hi) of this rank's partition holding its pieces of the
        round's matrices (one range: a group's matrices lie in layout order). Fixed by the layout."""
        return self._spans[i]

    def _held_ranges(self, matrices: list[MuonMatrix]) -> dict[int, tuple[int, int]]:
        out: dict[int, tuple[int, int]] = {}
        for m in matrices:
            for p in self.held(m, self.rank):
                lo, hi = out.get(m.group, (p.part_offset, p.part_offset + p.length))
                out[m.group] = (min(lo, p.part_offset), max(hi, p.part_offset + p.length))
        return out

    def lr_factors(self, g: int) -> list[tuple[int, int, float]] | None:
        """Group ``g``'s per-matrix learning-rate factors (torch's shape-adjusted lr) as (lo, hi, factor) ranges of
        this rank's partition, or None where every factor is 1 (DeepSpeed's scale is in the update itself)."""
        rule = self.rules[g]
        if rule is None or rule.flavor != "torch":
            return None
        return [(p.part_offset, p.part_offset + p.length, rule.lr_factor(m.shape))
                for m in self.matrices if m.group == g for p in self.held(m, self.rank)]

    @torch.no_grad()
    def orthogonalize_round(self, i: int, updates: dict[int, torch.Tensor], results: dict[int, torch.Tensor],
                            bases: dict[int, int] | None = None) -> None:
        """Round ``i`` of a step, a collective: per Muon group ``g``, ``updates[g]`` holds this rank's 1-D fp32 update
        from element ``bases[g]`` (default 0) of its partition on, at least over the round's `spans`; the
        orthogonalized update of each of the round's pieces is written into ``results[g]`` (fp32), indexed alike."""
        bases = bases or {}
        matrices, up, down = self.rounds[i]
        whole = self._gather(matrices, up, updates, bases)
        out = {m.name: orthogonalize(whole[m.name].view(m.shape), self.rules[m.group], m.num_heads).reshape(-1)
               for m in matrices if m.owner == self.rank}
        self._exchange(down, out, results, self.down_dtype, bases)

    def _gather(self, matrices: list[MuonMatrix], up: _Exchange, updates: dict[int, torch.Tensor],
                bases: dict[int, int]) -> dict[str, torch.Tensor]:
        """Step 1: every matrix this rank owns, whole, flat on the device."""
        whole = {m.name: torch.empty(m.numel, dtype=torch.float32, device=self.device)
                 for m in matrices if m.owner == self.rank}
        if self.replicated:
            for m in matrices:
                if m.owner == self.rank:
                    at = bases.get(m.group, 0)
                    for p in m.pieces:
                        whole[m.name][p.param_offset:p.param_offset + p.length] = \
                            updates[m.group][p.part_offset - at:p.part_offset - at + p.length]
            return whole
        self._exchange(up, updates, whole, torch.float32, bases)
        return whole

    def _exchange(self, plan: _Exchange, sources: dict, targets: dict, dtype: torch.dtype,
                  bases: dict[int, int]) -> None:
        """One all-to-all of ``plan``: its pieces of ``sources`` sent in ``dtype``, the received ones written into
        ``targets`` (a group's tensors start at element ``bases[g]`` of its partition)."""
        pieces = [sources[key][at - bases.get(key, 0):at - bases.get(key, 0) + n] for key, at, n in plan.send]
        send = torch.cat(pieces).to(self.device, dtype) if pieces else torch.empty(0, dtype=dtype, device=self.device)
        if plan.crossing:
            recv = torch.empty(sum(plan.out_splits), dtype=dtype, device=self.device)
            self.all_to_all(recv, send, plan.out_splits, plan.in_splits)
        else:                     # every piece stays on its rank: the same pieces, in the same order
            recv = send
        done = 0
        for key, at, n in plan.recv:
            at -= bases.get(key, 0)
            targets[key][at:at + n] = recv[done:done + n]
            done += n
