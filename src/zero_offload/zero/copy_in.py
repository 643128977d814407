"""The next forward waits for each module's own updated parameters, not for the whole copy up (issue 27, item 3).

Opt-in: ``ZERO_OFFLOAD_PER_MODULE_WAITS=1`` (see `ENV`); by default every step waits for its whole copy up.

After a host optimizer step at one rank (stages 0-2, optimizer offloaded, no all-gather behind the step), the
updated 16-bit parameters go up to the device in chunks, in the order the next forward reads them (`forward_order`).
Waiting for every chunk before the next forward leaves the device idle for the whole copy (0.38 s per step at
10B parameters on an H200). Here the compute stream waits, in each
module's forward pre-hook, only for the chunks that hold that module's own parameters (FSDP2's per-module
copy-in; its unit is a ``fully_shard`` module, here every module that owns parameters).

Two guards keep the rule "parameters are current after ``engine.step()``" (DeepSpeed's) true for code that
reads parameters some other way:

- **between the step and the next forward** a `TorchFunctionMode` is on the mode stack: any torch function that
  takes a managed parameter (an EMA update, ``state_dict()``, a norm for logging) first makes the compute stream
  wait for every copy up; the first module pre-hook removes the mode;
- **the first forward after the first such step** runs under the same mode in checking form: a parameter read
  before the forward of the module that owns it (a parent reading a child's weight directly, which FSDP2 leaves
  to the user) makes every later step wait for the whole copy up, with one warning naming the parameter.

Backward (`ZeroOptimizer.begin_micro_step`), a new step and `close` wait for whatever is still pending. A model
compiled (whole or in part) is waited for whole after each step: at `initialize`, or from the first step after
``model.compile()``. On a
machine without an accelerator every copy has landed already, and the waits cost nothing; under
``ZERO_OFFLOAD_SIMULATE_STREAMS=1`` each wait blocks until its copy has run, which is what the tests check.
"""
from __future__ import annotations

import os
import warnings
from typing import Protocol, runtime_checkable

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from zero_offload.compiling import is_compiled_module

__all__ = ["CopyUpQueue", "CopyInWaits", "ParamRead", "compiled", "forward_order", "ENV", "enabled"]

# Opt-in while the guard is a torch function mode on the thread's global stack: an engine dropped without `close`
# after a step leaves it there, holding the engine, until the next forward (and at interpreter exit).
ENV = "ZERO_OFFLOAD_PER_MODULE_WAITS"


def enabled() -> bool:
    """Whether ``ZERO_OFFLOAD_PER_MODULE_WAITS`` asks for per-module waits (read when an engine is built)."""
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a submodule is compiled (``torch.compile(m)`` or ``m.compile()``): its hooks would run
    inside dynamo's frames, where a stream wait or a mode change breaks the graph (and the mode is traced)."""
    return any(is_compiled_module(m) for m in module.modules())


def forward_order(spans, numels: list[int], chunk: int) -> list[tuple[int, int, int]]:
    """The chunks ``(group, lo, hi)`` of the partitions in the order the next forward reads them.

    Each chunk is keyed by the forward position of the first parameter it holds, the keys kept non-decreasing
    along each group, so a group's chunks stay in element order (`CopyUpQueue.wait_copies_up` relies on it).
    Without it every copy of the decayed group (the weights) would be queued before the first layer norm
    of the no-decay group, and the first block's forward would wait for nearly the whole copy up.

    Args:
        spans: ``(position, group, lo, hi)`` per parameter: its index in module order, and its elements
            [lo, hi) in that group's partition.
        numels: elements per group partition.
        chunk: elements per chunk (the last of a group may be shorter).
    """
    first: list[list[int | None]] = [[None] * -(-n // chunk) for n in numels]
    for pos, g, lo, hi in spans:
        for c in range(lo // chunk, (hi - 1) // chunk + 1):
            if first[g][c] is None or pos < first[g][c]:
                first[g][c] = pos
    keyed = []
    for g, keys in enumerate(first):
        running = -1
        for c, key in enumerate(keys):
            running = max(running, -1 if key is None else key)
            keyed.append((running, g, c))
    return [(g, c * chunk, min(numels[g], (c + 1) * chunk)) for _, g, c in sorted(keyed)]


@runtime_checkable
class CopyUpQueue(Protocol):
    """What a partition optimizer exposes of its copies up (`PartitionedAdam`): the compute stream's waits."""

    def defer_copy_up_waits(self) -> None:
        """From now on a step leaves its copies up pending instead of making the compute stream wait for all."""

    def order_copies_up(self, spans) -> None:
        """Queue the copies up in the order the forward reads the parameters (`forward_order`'s ``spans``)."""

    def pending_copies_up(self) -> bool:
        """Whether some copy up is queued that the compute stream has not waited for."""

    def wait_copies_up(self, needs: dict[int, int] | None = None) -> None:
        """The compute stream waits for the copies up of group g's partition elements [0, needs[g]) (every
        pending copy with ``needs=None``)."""


class ParamRead(TorchFunctionMode):
    """Calls ``on_read(id(param))`` before each torch function that takes one of ``params`` (by identity): in
    its arguments or the lists among them (``torch._foreach_*``). Pass-through otherwise."""

    def __init__(self, params, on_read):
        super().__init__()
        self.params, self.on_read = params, on_read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and id(t) in self.params:
                    self.on_read(id(t))
        return func(*args, **kwargs)


class CopyInWaits:
    """Per-module waits for the copies up of ``queue`` (see the module docstring).

    Args:
        queue: the partition optimizer whose copies up the forward waits for.
        where: per managed parameter (by identity), its name, group and the end of its elements in that group's
            partition (elements past the partition are not this rank's: never waited here).
    """

    def __init__(self, queue: CopyUpQueue, where: dict[int, tuple[str, int, int]]):
        self.queue, self.where = queue, where
        self.enabled = True           # False once a parameter was read outside its module's forward
        self.checked = False          # the first forward after a lazy step was checked
        self.waited: dict[int, int] = {}   # per group, elements [0, n) the compute stream has waited for
        self._mode: ParamRead | None = None
        self._stale: list[ParamRead] = []  # modes made inert where they could not be popped (inside their handler)
        self._hooks = []
        queue.defer_copy_up_waits()

    def attach(self, module: torch.nn.Module) -> None:
        """Register the pre-hooks: the root's removes the guard (and arms the check once), every module that
        owns managed parameters waits for its own chunks."""
        self.module = module
        self._hooks.append(module.register_forward_pre_hook(self._root_pre))
        self._hooks.append(module.register_forward_hook(self._root_post))
        for m in module.modules():
            needs: dict[int, int] = {}
            for p in m.parameters(recurse=False):
                if id(p) in self.where:
                    _, g, end = self.where[id(p)]
                    needs[g] = max(needs.get(g, 0), end)
            if needs:
                self._hooks.append(m.register_forward_pre_hook(lambda _m, _a, needs=needs: self._wait(needs)))

    # -- the step side ----------------------------------------------------------------------------------
    def after_step(self) -> None:
        """The step left copies up pending: guard every read until the next forward starts."""
        if not self.queue.pending_copies_up():
            return
        if self.enabled and compiled(self.module):
            self.enabled = False            # compiled after initialize: its graphs would trace the hooks and guards
        if not self.enabled:
            self.wait_all()
            return
        self._drop_stale()
        self.waited = {}
        self._push(ParamRead(self.where, lambda _key: self.wait_all()))

    def wait_all(self) -> None:
        """The compute stream waits for every pending copy up (backward, a new step, a read outside forward)."""
        self._pop()
        if self.queue.pending_copies_up():
            self.queue.wait_copies_up(None)

    def close(self) -> None:
        """Wait for what is pending and remove the hooks and the guards."""
        self.wait_all()
        self._drop_stale()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- the forward side -------------------------------------------------------------------------------
    def _wait(self, needs: dict[int, int]) -> None:
        if not self.queue.pending_copies_up():
            return
        missing = {g: n for g, n in needs.items() if self.waited.get(g, 0) < n}
        if missing:
            self.queue.wait_copies_up(missing)
            for g, n in missing.items():
                self.waited[g] = max(self.waited.get(g, 0), n)

    def _root_pre(self, _module, _args) -> None:
        self._pop()
        self._drop_stale()
        if self.enabled and not self.checked and self.queue.pending_copies_up():
            self.checked = True
            self._push(ParamRead(self.where, self._check_read))

    def _root_post(self, _module, _args, _out) -> None:
        self._pop()

    def _check_read(self, key: int) -> None:
        """A parameter read during the checked forward: it must lie inside what was waited for."""
        name, g, end = self.where[key]
        if self.waited.get(g, 0) < end and self.queue.pending_copies_up():
            warnings.warn(f"parameter {name!r} was read before the forward of the module that owns it: every step "
                          f"now waits for the whole copy up of the parameters before the next forward (call the "
                          f"module, or read the parameter inside its forward, to keep the per-module waits)",
                          stacklevel=3)
            self.enabled = False
            self.wait_all()

    def _push(self, mode: ParamRead) -> None:
        self._pop()
        mode.__enter__()
        self._mode = mode

    def _pop(self) -> None:
        """Remove the guard when it is the top of the mode stack. Else make it inert and remove it later
        (`_drop_stale`): inside its own handler (a read that triggered `wait_all`) torch has taken it off the stack
        for the call, and a mode the user pushed above it stays where it is."""
        mode, self._mode = self._mode, None
        if mode is None:
            return
        stack = _get_current_function_mode_stack()
        if stack and stack[-1] is mode:
            mode.__exit__(None, None, None)
        else:
            mode.on_read = lambda _key: None
            self._stale.append(mode)

    def _drop_stale(self) -> None:
        """Remove the inert guards that are on top of the mode stack now (outside any handler)."""
        while self._stale:
            stack = _get_current_function_mode_stack()
            if not stack or stack[-1] is not self._stale[-1]:
                return
            self._stale.pop().__exit__(None, None, None)
