"""`PartitionedMuon`: Muon for the matrices and AdamW for the rest, over one partition per param group.

DeepSpeed's ``"type": "Muon"`` (``MuonWithAuxAdam``) and ``torch.optim.Muon`` with a torch AdamW beside it; the
Adam halves of the param groups (`zero_offload.param_groups.takes_muon`) are `PartitionedAdam`'s. A Muon group keeps
its fp32 masters and momentum partitioned where the optimizer state lives, and steps round by round of the owners'
exchanges (`MuonOwners.spans`: the working memory is one round's): the momentum pass on the partition
(`zero_offload.optim.muon_pass.momentum_pass`), each whole matrix orthogonalized once by its owner (`MuonOwners`),
then weight decay and the update on the partition (`apply_update`) and the 16-bit parameters written from the masters
(docs/muon.md, "One step"). A step the engine skips (fp16 overflow, found before `step`) never reaches the momentum.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from zero_offload.hoststep.adam import PartitionedAdam
from zero_offload.hoststep.muon_owners import MuonOwners, RoundWindows
from zero_offload.hoststep.role import GradSource
from zero_offload.offload.copies import Copies
from zero_offload.optim.muon import MuonRule
from zero_offload.optim.muon_pass import momentum_pass, update_pass
from zero_offload.runtime.state import fill_from_chunks

__all__ = ["PartitionedMuon", "muon_rule", "apply_update"]


def muon_rule(h: dict) -> MuonRule | None:
    """A param group's `MuonRule` from its hyper-parameters (`zero_offload.config.optim.MuonParams.half`), or None
    for a group Adam steps."""
    if not h.get("use_muon"):
        return None
    return MuonRule(flavor=h["flavor"], momentum=h["momentum"], nesterov=h["nesterov"], ns_method=h["ns_method"],
                    ns_steps=h["ns_steps"], coefficients=tuple(h["ns_coefficients"]), eps=h["ns_eps"],
                    adjust_lr=h["adjust_lr_fn"])


def apply_update(master: torch.Tensor, result: torch.Tensor, lo: int, lr: float, weight_decay: float,
                 factors: list[tuple[int, int, float]] | None) -> None:
    """Muon's update of elements [lo, lo + len(master)) of a group's fp32 master partition, in place: decoupled
    weight decay, then ``- lr x factor x result`` (`zero_offload.optim.muon_pass.update_pass`; ``factors``:
    `MuonOwners.lr_factors`, partition ranges, each piece with its own; None: factor 1 everywhere)."""
    hi = lo + master.numel()
    for a, b, factor in factors if factors is not None else [(lo, hi, 1.0)]:
        a, b = max(a, lo), min(b, hi)
        if a < b:
            update_pass(master[a - lo:b - lo], result[a - lo:b - lo], lr, weight_decay, factor)


class PartitionedMuon(PartitionedAdam):
    """`PartitionedAdam` whose Muon groups are stepped by Muon (module docstring).

    Args:
        parts, hparams, offload, copies, host_params: as `PartitionedAdam`; a Muon group's ``hparams`` carry
            ``use_muon`` and its rule's keys (`muon_rule`).
        owners: who orthogonalizes each Muon matrix, and the exchanges (`MuonOwners`); its ``rules`` say which
            groups Muon steps.

    Attributes:
        momenta: per Muon group, its fp32 momentum partition (beside its master).
    """

    def __init__(self, parts: list[torch.Tensor], hparams: list[dict], offload: bool, copies: Copies,
                 owners: MuonOwners, host_params: bool = False, clip_update: bool = False):
        super().__init__(parts, hparams, offload, copies, host_params=host_params)
        self.clip_update = clip_update     # DeepSpeed's order: the update is made before the norm (`prepare_updates`)
        self._prepared: tuple[float, dict, dict] | None = None    # (grad_scale, updates, momenta before)
        self.rules, self.owners = owners.rules, owners
        self.lr_factors = [owners.lr_factors(g) for g in range(len(parts))]
        self.momenta = {g: torch.zeros(m.numel(), dtype=torch.float32, device=m.device)
                        for g, m in enumerate(self.masters) if self.rules[g] is not None}
        self.muon_steps = [0] * len(parts)
        device = next((m.device for g, m in enumerate(self.masters) if self.rules[g] is not None), torch.device("cpu"))
        self.windows = RoundWindows(owners, device)

    def adam_steps(self, g: int) -> bool:
        return self.rules[g] is None

    @torch.no_grad()
    def step(self, grads: Sequence[GradSource], grad_scale: float, lrs: Sequence[float] | None = None,
             publish: bool = True) -> None:
        """One step of every group (the `PartitionOptimizer` role): the Muon groups (a collective: every rank at
        the same step), then the Adam groups by `PartitionedAdam.step`.

        Raises:
            RuntimeError: a gradient source with copies still in flight (`GradSource.ready`).
        """
        muon = sorted(self.momenta)
        if self._prepared is not None:      # DeepSpeed's order: the update, clipped with the rest (`prepare_updates`)
            scale, prepared, _ = self._prepared
            self._prepared = None
            for g in muon:
                lr = lrs[g] if lrs is not None else self.optimizer.param_groups[g]["lr"]
                apply_update(self.masters[g], prepared[g].mul_(grad_scale / scale), 0, lr,
                             self.optimizer.param_groups[g]["weight_decay"], self.lr_factors[g])
        else:
            for g, lo, hi, result in self._updates(grads, grad_scale):
                lr = lrs[g] if lrs is not None else self.optimizer.param_groups[g]["lr"]
                apply_update(self.masters[g][lo:hi], result, lo, lr,
                             self.optimizer.param_groups[g]["weight_decay"], self.lr_factors[g])
        for g in muon:
            self.muon_steps[g] += 1
        if len(muon) < len(self.parts):
            super().step(grads, grad_scale, lrs, publish)
        self.write_parts(muon)

    def _updates(self, grads: Sequence[GradSource], grad_scale: float):
        """Yield (group, lo, hi, this rank's orthogonalized update of partition range [lo, hi)) round by round (the
        working memory is one round's), folding ``grads[g] x grad_scale`` into the momentum on the way (a
        collective: the owners' exchanges)."""
        muon = sorted(self.momenta)
        ready = {g: grads[g].ready() for g in muon}
        for i in range(len(self.owners.rounds)):
            spans = self.owners.spans(i)
            updates, results = self.windows.views(spans)
            for g, (lo, hi) in spans.items():
                momentum_pass(self.momenta[g][lo:hi], ready[g][lo:hi], grad_scale, self.rules[g], out=updates[g])
            self.owners.orthogonalize_round(i, updates, results, {g: lo for g, (lo, _) in spans.items()})
            for g, (lo, hi) in spans.items():
                yield g, lo, hi, results[g]

    @torch.no_grad()
    def prepare_updates(self, grads: Sequence[GradSource], grad_scale: float) -> dict[int, torch.Tensor]:
        """DeepSpeed 0.19.8's ZeRO order (``clip_update``): fold the unclipped gradient (x ``grad_scale``, 1 / loss
        scale) into each Muon group's momentum and orthogonalize now, before the global norm, so that
        ``gradient_clipping`` covers the update with the AdamW half's gradients; `step` then applies the update x
        the clip coefficient. Returns {Muon group: this rank's sum of squares of its update / grad_scale², a 0-dim
        fp32 CPU tensor} (in the loss-scaled units of the gradients' own pieces), {} in the other order. The
        momenta as they were are kept until `step` or `discard_prepared` (a skipped step leaves them unchanged).
        A collective where the owners exchange."""
        if not self.clip_update or not self.momenta:
            return {}
        before = {g: m.clone() for g, m in self.momenta.items()}
        prepared = {g: torch.zeros_like(m) for g, m in self.momenta.items()}
        for g, lo, hi, result in self._updates(grads, grad_scale):
            prepared[g][lo:hi].copy_(result)
        self._prepared = (grad_scale, prepared, before)
        return {g: (u.double().pow(2).sum() / grad_scale ** 2).float().cpu() for g, u in prepared.items()}

    def discard_prepared(self) -> None:
        """The boundary takes no step (fp16 overflow): the momenta go back to what they were before
        `prepare_updates`."""
        if self._prepared is not None:
            for g, m in self._prepared[2].items():
                self.momenta[g].copy_(m)
            self._prepared = None

    # -- state: the momentum in the checkpoint's exp_avg slot, exp_avg_sq zeros ----------------------------------
    def state_format(self) -> str:
        """``muon``: a Muon group's ``exp_avg`` slot holds its momentum (Adam groups as ``adam``)."""
        return "muon"

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """As `PartitionedAdam`, with the Muon groups' momenta under ``exp_avg``."""
        kinds = super().state_tensors()
        kinds["exp_avg"] = kinds["exp_avg"] + list(self.momenta.values())
        return kinds

    def group_step(self, g: int) -> int:
        return self.muon_steps[g] if g in self.momenta else super().group_step(g)

    def _moments(self, g: int) -> list[torch.Tensor | None]:
        return [self.momenta[g], None] if g in self.momenta else super()._moments(g)

    @torch.no_grad()
    def load_state_chunks(self, g: int, step: int, chunks: Iterable[tuple[int, dict[str, torch.Tensor]]]) -> None:
        """Replace group ``g``'s state from `state_chunks`' pieces (a Muon group: master and momentum).

        Raises:
            ValueError: pieces that do not cover the partition (`zero_offload.runtime.state.fill_from_chunks`).
        """
        if g not in self.momenta:
            super().load_state_chunks(g, step, chunks)
            return
        fill_from_chunks(chunks, g, {"master": self.masters[g], "exp_avg": self.momenta[g]})
        self.muon_steps[g] = step
        self.write_parts([g])
