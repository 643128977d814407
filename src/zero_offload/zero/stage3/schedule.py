"""The stage-3 fetch order: recorded on the first micro-step, replayed after, and what to prefetch from it.

A policy with no side effects on the units (DeepSpeed's ``PartitionedParameterCoordinator`` trace, FSDP2's implicit
forward order): `UnitLifecycle` tells it each fetch and asks what to gather ahead and whether a unit comes back soon
enough to stay gathered. If the order changes (data-dependent control flow), replaying stops with one warning and
every unit is fetched on demand: the results stay exact. Forwards without autograd (evaluation, each token of
``generate()``) keep a trace of their own, so that they prefetch too. A fetch without autograd inside a training
step (a sequence-tiled forward runs its tiles so) belongs to neither: it is fetched on demand and recorded nowhere,
else the evaluation trace, never restarted without an evaluation, would grow by every step's tiles.
"""
from __future__ import annotations

import warnings

from zero_offload.zero.stage3.units import ShardedUnit

__all__ = ["FetchSchedule", "RECORDING", "REPLAYING", "ON_DEMAND"]

RECORDING, REPLAYING, ON_DEMAND = "recording", "replaying", "on-demand"


class Trace:
    """One recorded order of unit fetches and the position a replay has reached in it."""

    def __init__(self):
        self.mode = RECORDING
        self.order: list[int] = []
        self.position = 0
        self.stale = False          # the next pass records anew (the order changed on purpose)

    def restart(self) -> bool:
        """A new pass starts; True when it is the first replay (recording just ended)."""
        if self.stale:
            self.mode, self.order, self.stale = RECORDING, [], False
        first = self.mode == RECORDING and bool(self.order)
        if first:
            self.mode = REPLAYING
        self.position = 0
        return first

    def follow(self, index: int) -> bool:
        """Record or check the next fetch; False when it departs from the recorded order (now on demand)."""
        if self.mode == RECORDING:
            self.order.append(index)
        elif self.mode == REPLAYING:
            if self.position < len(self.order) and self.order[self.position] == index:
                self.position += 1
            else:
                self.mode = ON_DEMAND
                return False
        return True

    def upcoming(self) -> list[int]:
        """The unit indices still to come in a replay, next first (empty unless replaying)."""
        return self.order[self.position:] if self.mode == REPLAYING else []


class FetchSchedule:
    """The training and evaluation fetch orders of one model's units, and the prefetch and reuse decisions.

    Args:
        units: every unit, indexed by ``ShardedUnit.index``.
        prefetch_numel: elements gathered ahead of use (``stage3_prefetch_bucket_size``).
        max_live_numel: most elements gathered at once by prefetching (``stage3_max_live_parameters``).
        reuse_distance: keep a unit gathered if the trace uses it again within this many elements
            (``stage3_max_reuse_distance``).
    """

    def __init__(self, units: list[ShardedUnit], prefetch_numel: int, max_live_numel: int, reuse_distance: int):
        self.units = units
        self.prefetch_numel, self.max_live_numel, self.reuse_distance = prefetch_numel, max_live_numel, reuse_distance
        self.train, self.eval = Trace(), Trace()
        self.in_eval = False                      # an evaluation forward (no autograd, from the root) runs
        self.next_use: list[int] = []             # per trace position: elements fetched until the unit recurs
        self.last_position: dict[int, int] = {}   # unit index -> its latest position in this micro-step's replay

    def recording(self, training: bool) -> bool:
        """Whether the training (or evaluation) pass now running records its order."""
        return (self.train if training else self.eval).mode == RECORDING

    def record_again(self) -> None:
        """The fetch order changed on purpose (a unit joined the root): both traces record anew from the next pass."""
        self.train.stale = self.eval.stale = True

    def begin_micro_step(self) -> None:
        if self.train.restart():
            self._index_reuse()
        self.last_position.clear()

    def begin_eval_forward(self) -> None:
        self.eval.restart()
        self.in_eval = True

    def end_eval_forward(self) -> None:
        self.in_eval = False

    def follow(self, u: ShardedUnit, training: bool) -> None:
        """``u`` is fetched now, in a training pass (forward or backward) or an evaluation forward."""
        if not training and not self.in_eval:
            return                                # no autograd inside a training step: on demand, unrecorded
        trace = self.train if training else self.eval
        position = trace.position
        if trace.follow(u.index):
            if training and trace.mode == REPLAYING:
                self.last_position[u.index] = position
        elif training:
            warnings.warn("ZeRO stage 3: modules ran in a different order than in the first step "
                          "(data-dependent control flow); prefetching is off and parameters are "
                          "fetched on demand from now on", stacklevel=5)

    def upcoming(self, training: bool) -> list[ShardedUnit]:
        """The units the replay fetches next, in order (empty when not replaying)."""
        if not training and not self.in_eval:
            return []
        return [self.units[i] for i in (self.train if training else self.eval).upcoming()]

    def to_prefetch(self, upcoming: list[ShardedUnit], live_numel: int) -> list[int]:
        """Positions in ``upcoming`` to gather now: not yet gathered, within ``prefetch_numel`` elements of the
        next fetch and within ``max_live_numel`` elements gathered at once (``live_numel`` are gathered now)."""
        chosen, picked, ahead = [], set(), 0
        for pos, u in enumerate(upcoming):
            if ahead >= self.prefetch_numel:
                break
            ahead += u.numel
            if u.gathered or u.index in picked:
                continue
            if live_numel + u.padded_numel > self.max_live_numel:
                break
            live_numel += u.padded_numel
            picked.add(u.index)
            chosen.append(pos)
        return chosen

    def reused_soon(self, u: ShardedUnit, live_numel: int) -> bool:
        """Keep ``u`` gathered after its forward: the replay fetches it again within ``reuse_distance``."""
        pos = self.last_position.get(u.index)
        if self.train.mode != REPLAYING or pos is None or self.reuse_distance <= 0:
            return False
        return self.next_use[pos] <= self.reuse_distance and live_numel <= self.max_live_numel

    def _index_reuse(self) -> None:
        """For each trace position, the elements fetched before the same unit is fetched again."""
        order = self.train.order
        last: dict[int, int] = {}
        fetched = [0]
        for idx in order:
            fetched.append(fetched[-1] + self.units[idx].numel)
        self.next_use = [1 << 62] * len(order)
        for pos in range(len(order) - 1, -1, -1):
            idx = order[pos]
            if idx in last:
                self.next_use[pos] = fetched[last[idx]] - fetched[pos + 1]
            last[idx] = pos
