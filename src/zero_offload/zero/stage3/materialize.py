"""Turning a model's parameters into sharded units without ever holding the whole model on a rank.

A model built normally (on the CPU) is copied unit by unit: each unit's full buffer lives on the device
only until its shard is taken. A model built under `init_sharded` has meta parameters and no memory at
all; here each module is materialised in module order, initialised by ``param_init_fn(module)`` (FSDP's
name for it) or its own ``reset_parameters()``, and every unit is sharded and freed as soon as the last
module that uses it (a tied weight is used twice) has been initialised. Peak: one module's parameters
plus the tied units still open, on top of the shards.
"""
from __future__ import annotations

from typing import Callable

import torch

from zero_offload.zero.stage3.sharded_init import fill_view, has_slice, pop_slices
from zero_offload.zero.stage3.units import ShardedUnit
from zero_offload.zero.stage3.swap import swap_keeping_attributes

__all__ = ["materialize", "is_meta_model"]


def is_meta_model(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())


def _place_rest(module: torch.nn.Module, unit_params: set[int], device, dtype) -> None:
    """Move (or materialise) the module's own buffers and frozen parameters to the compute device."""
    for name, b in module._buffers.items():
        if b is not None:
            floating = b.is_floating_point()
            target = dict(device=device, dtype=dtype if floating else b.dtype)
            module._buffers[name] = torch.empty_like(b, **target) if b.is_meta else b.to(**target)
    for p in module.parameters(recurse=False):
        if id(p) in unit_params:
            continue
        new = torch.empty_like(p, device=device, dtype=dtype) if p.is_meta else p.detach().to(device, dtype)
        swap_keeping_attributes(p, torch.nn.Parameter(new, requires_grad=p.requires_grad))


def _default_init(module: torch.nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


@torch.no_grad()
def materialize(model: torch.nn.Module, units: list[ShardedUnit], module_units: dict, bind: Callable,
                device: torch.device, dtype: torch.dtype, param_init_fn: Callable | None) -> int:
    """Attach every unit's parameters, give it its shard via ``bind(unit)``, and release non-persistent units;
    also place buffers and frozen parameters on ``device``. Returns the most bytes of full (unsharded) unit
    buffers held at once, measured from their storages."""
    unit_params = {id(p) for u in units for p in u.params}
    held = lambda: sum(u.full.untyped_storage().nbytes() for u in units)  # noqa: E731
    peak = 0
    if not is_meta_model(model):
        for u in units:
            u.open()
            u.attach_params()
            peak = max(peak, held())
            bind(u)
            if not u.persistent:
                u.release()
        for module in model.modules():
            _place_rest(module, unit_params, device, dtype)
        return peak
    init = param_init_fn or _default_init
    last_user = {}
    for module in model.modules():
        for u in module_units.get(module, []):
            last_user[u.index] = module
    opened: set[int] = set()
    for module in model.modules():
        needed = module_units.get(module, [])
        lacking = False                  # a meta parameter with no constructor values (plain meta build)
        for u in needed:
            if u.index not in opened:
                slices = pop_slices(u.params)
                lacking |= any(p.is_meta and id(p) not in slices for p in u.params)
                u.open()                 # zeroed: padding and anything an init function leaves alone
                u.attach_params()        # swaps the meta parameters for views into `full`
                for p, s in zip(u.params, u.slots):
                    if id(p) in slices:  # built under init_sharded: the constructor's values
                        fill_view(slices[id(p)], u.full[s.offset:s.end].view(s.shape))
                opened.add(u.index)
        for p in module.parameters(recurse=False):
            if id(p) not in unit_params and has_slice(p):    # frozen: not in a unit
                state = pop_slices([p])[id(p)]
                real = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                          requires_grad=p.requires_grad)
                fill_view(state, real.data)
                swap_keeping_attributes(p, real)
        has_meta_rest = any(t.is_meta for t in module.buffers(recurse=False)) or \
            any(p.is_meta for p in module.parameters(recurse=False) if id(p) not in unit_params)
        _place_rest(module, unit_params, device, dtype)
        if (needed or has_meta_rest) and (param_init_fn is not None or lacking or has_meta_rest):
            init(module)
        peak = max(peak, held())
        for u in needed:
            if last_user[u.index] is module:
                bind(u)
                if not u.persistent:
                    u.release()
    return peak
