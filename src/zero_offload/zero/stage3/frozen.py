"""Frozen parameters (``requires_grad=False``) at stage 3: sharded 1/N like trainable ones, never optimized.

As DeepSpeed's ``zero.Init`` partitions every parameter, a frozen one lives in a sharded unit too (flagged
``frozen``), gathered for its module's forward and backward, with no gradient hook, reduce-scatter, gradient
partition, master weight or optimizer state; its shards live in one flat "frozen partition" per rank. With no
gradient to wait for, a frozen unit is released once its module's input gradient is computed; one released too
early is gathered again when backward reads it (`saved_params`), so the timing affects memory, never values.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

from zero_offload.zero.stage3.units import ShardedUnit, modules_owning

__all__ = ["build_frozen_units", "FrozenRelease", "frozen_names"]


def build_frozen_units(model: torch.nn.Module, first_index: int, world_size: int, device: torch.device,
                       dtype: torch.dtype, persistence_threshold: int) -> list[ShardedUnit]:
    """One frozen unit per module that owns (first holds) some ``requires_grad=False`` parameters, in module
    order; indices continue from ``first_index``. A frozen parameter's slot name is its first qualified name."""
    position = {id(p): (i, n) for i, (n, p) in enumerate(model.named_parameters())}
    return [ShardedUnit(first_index + k, -1, name, own, [position[id(p)][1] for p in own],
                        [position[id(p)][0] for p in own], world_size, device, dtype, persistence_threshold,
                        frozen=True)
            for k, (name, own) in enumerate(modules_owning(model, lambda p: not p.requires_grad))]


def frozen_names(model: torch.nn.Module, units: list[ShardedUnit]) -> dict[str, tuple[ShardedUnit, int]]:
    """Every qualified name under which a frozen unit's parameter appears among the modules' own parameters
    (tied aliases included, as `zero_offload.checkpoint.io.module_state` lists them) -> (unit, slot index)."""
    where = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
    out = {}
    for prefix, m in model.named_modules():
        for name, p in m._parameters.items():
            if p is not None and id(p) in where:
                out[f"{prefix}.{name}" if prefix else name] = where[id(p)]
    return out


class FrozenRelease:
    """Releases a module's non-persistent frozen units after its backward (see the module docstring)."""

    def __init__(self, release: Callable[[ShardedUnit], None], module_units: dict[torch.nn.Module, list[ShardedUnit]]):
        self.release = release            # the life cycle's release (it keeps the count of gathered bytes)
        self.hooks = []
        for module, units in module_units.items():
            frozen = [u for u in units if u.frozen and not u.persistent]
            if frozen:
                self.hooks.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs, frozen=frozen: self._arm(frozen, args, kwargs), with_kwargs=True))

    def _arm(self, units: list[ShardedUnit], args, kwargs) -> None:
        if not torch.is_grad_enabled():
            return
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            return      # nothing flows back through this module: the forward's release is the last
        fired = [False]

        def release_after_backward(grad, units=units, fired=fired):
            if not fired[0]:
                fired[0] = True
                for u in units:
                    if u.gathered and not u.persistent:
                        self.release(u)
            return grad
        for t in inputs:
            t.register_hook(release_after_backward)
