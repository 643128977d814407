"""`NvmeMuon`: optimizer type Muon with the states in swap files (``offload_optimizer.device = nvme``).

`NvmeAdam`'s files, pool and pipeline, with the Muon groups stepped as `PartitionedMuon` steps them, round by round
of the owners' exchanges: a momentum pass streams the round's sub-groups' momentum (the ``exp_avg`` file) in, folds
the gradient into it and writes it back, keeping the round's updates in host memory; the owners orthogonalize; a
master pass streams the masters in, applies decay and the update, writes them back and sends the parameters on as
the Adam step does. A Muon group keeps two fp32 files (master, momentum), each read and written once per step; host
memory beyond the pool is two fp32 windows of the largest round (`RoundWindows`). See docs/muon.md.
"""
from __future__ import annotations

from typing import Sequence

import torch

from zero_offload.hoststep.muon import apply_update
from zero_offload.hoststep.muon_owners import MuonOwners, RoundWindows
from zero_offload.hoststep.nvme_adam import NvmeAdam
from zero_offload.hoststep.nvme_state import KINDS
from zero_offload.optim.muon_pass import momentum_pass

__all__ = ["NvmeMuon", "MUON_KINDS"]

MUON_KINDS = ("master", "exp_avg")         # a Muon group's files: its master and its momentum


class NvmeMuon(NvmeAdam):
    """`NvmeAdam` whose Muon groups are stepped by Muon (module docstring).

    Args:
        parts, hparams, copies, directory, sub_group_size, buffer_count, options: as `NvmeAdam` (the masters and
            moments fp32: bf16 states with Muon are refused with the config).
        owners: as `PartitionedMuon`.
    """

    def __init__(self, parts: list[torch.Tensor], hparams: list[dict], copies, directory, sub_group_size: int,
                 buffer_count: int, *, owners: MuonOwners, **options):
        self.owners, self.rules = owners, owners.rules       # before the files are opened: `group_kinds`
        super().__init__(parts, hparams, copies, directory, sub_group_size, buffer_count, **options)
        self.lr_factors = [owners.lr_factors(g) for g in range(len(parts))]
        self.windows = RoundWindows(owners, torch.device("cpu"))
        # per round, the (sub-group, a, b) pieces of the sub-groups that hold its elements: fixed by the layout
        self.round_work = [[(k, max(lo, spans[g][0]), min(hi, spans[g][1])) for k, (g, _, lo, hi)
                            in enumerate(self.units) if g in spans and max(lo, spans[g][0]) < min(hi, spans[g][1])]
                           for spans in map(owners.spans, range(len(owners.rounds)))]

    def group_kinds(self, g: int) -> tuple[str, ...]:
        """A Muon group's files: its master and momentum (`MUON_KINDS`); an Adam group's all three."""
        return MUON_KINDS if self.rules[g] is not None else KINDS

    def state_format(self) -> str:
        """``muon``: a Muon group's ``exp_avg`` slot holds its momentum (`PartitionedMuon.state_format`)."""
        return "muon"

    def _step(self, grads: list[torch.Tensor], grad_scale: float, lrs: Sequence[float] | None) -> None:
        self.steps = [s + 1 for s in self.steps]
        self._adam_pass([k for k, unit in enumerate(self.units) if self.rules[unit[0]] is None],
                        grads, grad_scale, lrs)
        for i in range(len(self.owners.rounds)):
            self._muon_round(i, grads, grad_scale, lrs)
        self._drain_timed()

    def _muon_round(self, i: int, grads: list[torch.Tensor], grad_scale: float,
                    lrs: Sequence[float] | None) -> None:
        """Round ``i`` of the Muon groups' step: momentum pass, the owners' exchange, master pass."""
        spans, work = self.owners.spans(i), self.round_work[i]
        updates, results = self.windows.views(spans)

        def momentum(k: int, slot: int, a: int, b: int) -> None:
            g, _, lo, hi = self.units[k]
            base = spans[g][0]
            momentum_pass(self._views(slot, hi - lo)[1][a - lo:b - lo], grads[g][a:b], grad_scale, self.rules[g],
                          out=updates[g][a - base:b - base])
        self._stream(work, ("exp_avg",), momentum)     # its writes may fly on: the master pass reads other files
        self.owners.orthogonalize_round(i, updates, results, {g: lo for g, (lo, _) in spans.items()})

        def update(k: int, slot: int, a: int, b: int) -> None:
            g, _, lo, hi = self.units[k]
            master = self._views(slot, hi - lo)[0][a - lo:b - lo]
            h = self.optimizer.param_groups[g]
            base = spans[g][0]
            apply_update(master, results[g][a - base:b - base], a, h["lr"] if lrs is None else lrs[g],
                         h["weight_decay"], self.lr_factors[g])
            target, out = self._param_outputs(k, slot, a, b, land=False)
            if out is not None:
                out.copy_(master)
            self._send_params(g, a, target, out, master, land=False)
        self._stream(work, ("master",), update)
        self._drain()            # a sub-group the next round touches again is read after its writes
