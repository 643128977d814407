"""Stage-3 parameters that autograd saved for backward are gathered again when backward reads them.

A parameter used outside its module's forward (a tied embedding in a custom loss, a weight read by its parent's
forward) escapes the module hooks: its unit is released and backward would read freed storage. While a training
micro-step runs, a ``saved_tensors_hooks`` pair marks every saved tensor that is a view of a unit's full buffer;
unpacking one gathers that unit again if it was released (into the same storage, so the saved view is valid), to be
released with the others at the end of the micro-step. Under these hooks autograd unpacks a saved parameter as a
new tensor aliasing it (not the Parameter object): `ShardedUnit.param_at` finds the parameter an alias views.
DeepSpeed leaves this to ``register_external_parameter``.
"""
from __future__ import annotations

from typing import Callable

import torch

from zero_offload.zero.stage3.units import ShardedUnit

__all__ = ["SavedParameterGuard"]


class SavedParameterGuard:
    """Install with `start` before a training forward, remove with `stop` after its backward; ``gather`` gathers
    one released unit of ``units`` (every unit of the model) now."""

    def __init__(self, units: list[ShardedUnit], gather: Callable[[ShardedUnit], None]):
        self.gather = gather              # the life cycle's gather, outside the recorded order
        self.units = units
        # A unit's storage object survives release/gather (only its size changes), so it identifies the unit; a
        # release that leaves the storage to views code kept gives the unit a new one, so `start` maps anew.
        self.by_storage = self._map()
        self._hooks = None
        self.regathered = 0               # units gathered again by backward (running count)

    def _pack(self, t: torch.Tensor):
        unit = self.by_storage.get(t.untyped_storage()._cdata) if t.layout == torch.strided else None
        return t, unit

    def _unpack(self, packed):
        t, unit = packed
        if unit is not None:
            if unit.gathered:
                unit.wait()
            else:
                self.gather(unit)
                self.regathered += 1
        return t

    def _map(self) -> dict:
        return {u.full.untyped_storage()._cdata: u for u in self.units}

    @property
    def active(self) -> bool:
        """Between `start` and `stop`: a training micro-step whose saved views must keep their storages."""
        return self._hooks is not None

    def unit_viewed_by(self, t: torch.Tensor) -> ShardedUnit | None:
        """The unit whose full buffer ``t`` views (by storage), or None."""
        return self.by_storage.get(t.untyped_storage()._cdata) if t.layout == torch.strided else None

    def start(self) -> None:
        self.by_storage = self._map()
        if self._hooks is None:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    def stop(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
