"""Stage-3 parameters read in forward outside their own module's forward are found and gathered for that read.

A released parameter has no storage (shape kept, ``numel`` 0 in its data). Code that reads a parameter without
calling its module (a fused LM-head loss that takes ``lm_head.weight`` straight into a kernel, as TRL's
``add_fused_lm_head`` does; a parent that reads a child's weight) would see an empty tensor and compute garbage
without an error. DeepSpeed leaves this to the caller (``GatheredParameters``, ``register_external_parameter``;
TRL gathers its head itself under DeepSpeed, ``maybe_gather_lm_head_ctx``).

Here, while a fetch order is being recorded (the first training forward, the first forward without autograd,
and the forward after a stray read was found) a `TorchFunctionMode` watches every torch function of the root
module's forward. A parameter of this engine among its arguments whose unit no module of this forward has
fetched is a stray read, whether the unit happens to be gathered now (a persistent unit, still gathered from
an earlier forward) or not: it is fetched before the function runs and registered as an external parameter
of the root module, so every later forward gathers it at its start and keeps it until its end (and backward
fetches it with the root's units); the recorded order is redone from the next forward. Any torch function
counts, attribute reads such as ``weight.device`` too: a custom autograd function records its inputs' shapes
before its ``forward`` runs, so the read that precedes it must already gather. Replayed forwards run without the
mode: it costs nothing once the order is known. A compiled model runs without it (a mode is traced by
dynamo): there, register such parameters with ``zero_offload.register_external_parameter``.
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
