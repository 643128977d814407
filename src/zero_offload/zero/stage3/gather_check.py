"""`GatherCheck`: every rank runs the same stage-3 module at each module forward, or all of them stop with an error
that names the modules and ranks, instead of a hang.

Each gather is a collective: ranks that gather different units send buffers of other sizes (gloo aborts, NCCL waits
until the collective deadline) or, with equal sizes, silently mix two units' weights. Before each module's forward in
the first micro-step, and in every micro-step with ``ZERO_OFFLOAD_CHECK_GATHERS=1`` (off by default: on CUDA each
exchange waits for the device), the ranks exchange the units the module is about to fetch (one small all-gather of a
Python object) and all raise `GatherMismatch` if they differ. Backward needs no check: its gathers follow one fixed
order (`UnitLifecycle`). FSDP2 and DeepSpeed have no such check.
"""
from __future__ import annotations

import os

from zero_offload.comm import DistContext, gather_objects
from zero_offload.zero.stage3.units import ShardedUnit

__all__ = ["CHECK_ENV", "GatherMismatch", "GatherCheck"]

CHECK_ENV = "ZERO_OFFLOAD_CHECK_GATHERS"


class GatherMismatch(RuntimeError):
    """The ranks were about to gather different stage-3 units (a module skipped in forward on some ranks)."""


class GatherCheck:
    """Compares the units the ranks of ``ctx`` gather next (see the module docstring); ``units``: every unit,
    indexed by ``ShardedUnit.index`` (named in the message)."""

    def __init__(self, ctx: DistContext, units: list[ShardedUnit]):
        self.ctx, self.units = ctx, units
        self.always = os.environ.get(CHECK_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")

    def before_forward(self, units: list[ShardedUnit], recording: bool) -> None:
        """Exchange the ``units`` a module's forward fetches with the other ranks when checking (``recording``:
        the first micro-step).

        Raises:
            GatherMismatch: another rank runs a module with other units; names every rank's module and units.
        """
        if not self.ctx.distributed or not (recording or self.always):
            return
        chosen = gather_objects(tuple(u.index for u in units), self.ctx.group)
        if len(set(chosen)) > 1:
            ranks = ", ".join(f"rank {r} runs module '{self._name(i)}' (units {list(i)})"
                              for r, i in enumerate(chosen))
            raise GatherMismatch(f"ZeRO stage 3: the ranks are about to gather different parameters: {ranks}. "
                                 "Every rank must run the same modules in the same order in forward; run the "
                                 "module on every rank and leave its output out of the loss where it is not "
                                 "wanted (backward may differ between ranks)")

    def _name(self, indices: tuple[int, ...]) -> str:
        return "+".join(self.units[i].module_name for i in indices) or "(none)"
