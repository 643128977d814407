"""Stage-3 parameters read in forward outside their own module's forward are found and gathered for that read.

A released parameter has no storage: code that reads one without calling its module (TRL's fused LM-head loss; a
parent reading a child's weight) would compute garbage without an error; DeepSpeed leaves this to the caller
(``GatheredParameters``, ``register_external_parameter``). While a fetch order is recorded, a `TorchFunctionMode`
watches every torch function of the root module's forward, attribute reads such as ``weight.device`` too (a custom
autograd function records its inputs' shapes before its ``forward`` runs): a parameter whose unit no module of this
forward fetched is gathered before the function runs and, from then on, with the root module (docs/hf.md).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["StrayReads"]


class StrayReads(TorchFunctionMode):
    """The watch over one root module's forward (see the module docstring).

    Args:
        unit_of: parameter -> its unit, for this engine's parameters.
        fetched: the units a module of the running forward has fetched (or the root holds).
        on_stray: called with the unit of a parameter that a torch function is about to read outside those;
            it fetches the unit and registers it with the root module.
        busy: True while the unit life cycle's own hooks run (their reads are the gathers themselves).
    """

    def __init__(self, unit_of, fetched: set, on_stray: Callable, busy: Callable[[], bool]):
        super().__init__()
        self.unit_of, self.fetched, self.on_stray, self.busy = unit_of, fetched, on_stray, busy
        self.found = 0          # stray reads found (running count)
        self.active = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.busy():
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.nn.Parameter):
                    u = self.unit_of.get(t)
                    if u is not None and u not in self.fetched:
                        self.found += 1
                        self.on_stray(u)
        return func(*args, **kwargs)

    def enter(self) -> None:
        """Push the mode (the root module's forward starts); no unit is fetched by this forward yet."""
        if not self.active:
            self.fetched.clear()
            self.__enter__()
            self.active = True

    def leave(self) -> None:
        """Pop the mode (the root module's forward ended, or raised)."""
        if self.active:
            self.active = False
            self.__exit__(None, None, None)
