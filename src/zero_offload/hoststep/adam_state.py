"""`AdamState`: the state face of `zero_offload.hoststep.adam.PartitionedAdam` (checkpoints, accounting).

The masters (fp32, or bf16) and Adam's moments of a partition in host or device memory, read and written in pieces
(`zero_offload.runtime.state.PartitionedOptimizerState`) and counted by kind for ``memory_breakdown``. A mixin of the one
class that holds them: it reads the owner's ``masters``, ``parts``, ``optimizer``, ``on_host``, ``speculation``,
``ring``, ``outs`` and ``incoming`` and calls its ``write_parts`` and ``discard_speculation``.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from zero_offload.runtime.state import WholeGroupState, fill_from_chunks

__all__ = ["AdamState"]


class AdamState(WholeGroupState):
    """Checkpoint pieces and memory kinds of Adam over one partition per param group (see the module docstring)."""

    @torch.no_grad()
    def write_master(self, g: int, offset: int, values: torch.Tensor) -> None:
        """Overwrite group ``g``'s fp32 master at ``offset`` with ``values`` (the `PartitionOptimizer` role)."""
        self.masters[g][offset:offset + values.numel()].copy_(values.reshape(-1))

    def swapped_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state in swap files, by kind: none, every state is in memory."""
        return {}

    def state_format(self) -> str:
        """The checkpoint's moment slots hold Adam's ``exp_avg`` and ``exp_avg_sq``."""
        return "adam"

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this optimizer holds, by kind: master, exp_avg, exp_avg_sq (one per group)."""
        states = [self.optimizer.state.get(m, {}) for m in self.masters]
        kinds = {"master": self.masters,
                 "exp_avg": [s["exp_avg"] for s in states if "exp_avg" in s],
                 "exp_avg_sq": [s["exp_avg_sq"] for s in states if "exp_avg_sq" in s]}
        if self.speculation is not None:
            kinds["speculative_state"] = self.speculation.bank.tensors()
        return kinds

    # -- state (the `PartitionedOptimizerState` protocol of zero_offload.runtime.state) ----------------------------
    def group_step(self, g: int) -> int:
        """Adam steps taken by group ``g`` (0 before the first)."""
        step = self.optimizer.state.get(self.masters[g], {}).get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)

    def state_chunks(self, g: int, chunk_numel: int = 1 << 24) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Group ``g``'s partition state in pieces, in increasing offset: (offset, {kind: fp32 CPU tensor of up to
        ``chunk_numel`` elements}) for kinds ``master``, ``exp_avg``, ``exp_avg_sq`` (zero moments before the first
        step). Pieces may be views of live state: read them before the next `step` or load."""
        master, moments = self.masters[g], self._moments(g)
        n = master.numel()
        for lo in range(0, n, max(1, chunk_numel)) if n else ():
            hi = min(n, lo + chunk_numel)
            piece = {"master": master[lo:hi].detach()}
            for kind, t in zip(("exp_avg", "exp_avg_sq"), moments):
                piece[kind] = t[lo:hi] if t is not None else torch.zeros(hi - lo)
            yield lo, {k: v.float().cpu() for k, v in piece.items()}

    def _moments(self, g: int) -> list[torch.Tensor | None]:
        """Group ``g``'s per-element states saved as ``exp_avg`` and ``exp_avg_sq`` (None: zeros)."""
        state = self.optimizer.state.get(self.masters[g], {})
        return [state.get("exp_avg"), state.get("exp_avg_sq")]

    @torch.no_grad()
    def load_state_chunks(self, g: int, step: int,
                          chunks: Iterable[tuple[int, dict[str, torch.Tensor]]]) -> None:
        """Replace group ``g``'s state from pieces that cover its partition (as `state_chunks` yields them), with
        ``step`` steps taken, and write its 16-bit parameters from the new masters.

        Raises:
            ValueError: pieces that do not exactly cover the partition (nothing is changed before the
                first piece is checked; a gap is reported after the pieces were written).
        """
        self.discard_speculation()
        mine = self.masters[g]
        n = mine.numel()
        if step > 0:
            state = self.optimizer.state.get(mine)
            if not state or "exp_avg" not in state:
                dtype = getattr(self.optimizer, "state_dtype", torch.float32)
                state = {"exp_avg": torch.zeros(n, dtype=dtype, device=mine.device),
                         "exp_avg_sq": torch.zeros(n, dtype=dtype, device=mine.device)}
            state["step"] = step if self.on_host else torch.tensor(float(step), device=mine.device)
            self.optimizer.state[mine] = state
        else:
            self.optimizer.state.pop(mine, None)
            state = {}
        targets = {"master": mine, **{k: state[k] for k in ("exp_avg", "exp_avg_sq") if k in state}}
        fill_from_chunks(chunks, g, targets)
        self.write_parts([g])

    def master_is_param(self, g: int) -> bool:
        """Group ``g``'s master has the parameters' dtype (bf16 masters): no rounding between them, and the
        copies up read the master itself."""
        return self.masters[g].dtype == self.parts[g].dtype != torch.float32

    def staging_tensors(self) -> list[torch.Tensor]:
        """Host buffers that only carry updated parameters up (the ring's slots, the delayed update's pinned 16-bit
        partitions, the speculated pieces' outputs) or gradients kept on the device down (`GradStream`)."""
        held = self.ring.tensors() if self.ring is not None else []
        held += self.stream.tensors() if self.stream is not None else []
        if self.deferred and not self.host_params:
            held += [o for o in self.outs if o is not None]
        if self.speculation is not None:
            held += [o for o in self.speculation.outs if o is not None]
        return held

    def incoming_tensors(self) -> list[torch.Tensor]:
        """The delayed update's device landing buffers (`incoming`: P x d bytes), empty without it."""
        return [t for t in self.incoming if t is not None]
