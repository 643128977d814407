"""Stage-3 state of the user's parameters and modules, kept beside them, never on them (as FSDP2's registry).

Weak maps keyed by object identity (`torch.utils.weak.WeakIdKeyDictionary`: a tensor's ``==`` is elementwise, so a
plain ``WeakKeyDictionary`` cannot hold tensors), each entry gone with its object: a parameter -> the stage-3
optimizer whose unit holds it (`owner_of`); a module -> the parameters its forward uses from other modules
(`register_external`); a parameter built under `init_sharded` -> this rank's slice of its constructor values
(`slice_of`); a view of one made under `init_sharded` -> the parameter and how to take the same view of its full
values (`alias_of`), so a write into the view reaches the slice; a module whose ``__init__`` runs under
`init_sharded` -> how deep its constructors are nested (`init_depth`); a module gathered whole as one unit
(`is_leaf`); a parameter -> its number in the order stage 3 met it, the same on every rank (`order_of`).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["manage", "owner_of", "register_external", "external_params", "set_slice", "slice_of", "pop_slice",
           "set_alias", "alias_of", "init_depth", "set_init_depth", "set_leaf", "is_leaf", "order_of", "owners"]

_OWNERS = WeakIdKeyDictionary()
_EXTERNAL = WeakIdKeyDictionary()
_SLICES = WeakIdKeyDictionary()
_ALIASES = WeakIdKeyDictionary()
_INIT_DEPTH = WeakIdKeyDictionary()
_LEAVES = WeakIdKeyDictionary()
_ORDER = WeakIdKeyDictionary()
_OWNER_SET: "weakref.WeakSet" = weakref.WeakSet()
_NEXT = itertools.count()


def manage(params, owner: Any) -> None:
    """Record that ``owner`` (a `Stage3Optimizer`) holds ``params`` in its units."""
    _OWNER_SET.add(owner)
    for p in params:
        _OWNERS[p] = owner
        if p not in _ORDER:
            _ORDER[p] = next(_NEXT)


def owners() -> list:
    """The live stage-3 optimizers that hold parameters."""
    return list(_OWNER_SET)


def owner_of(p: torch.Tensor) -> Any | None:
    """The stage-3 optimizer that holds ``p``, or None when no stage-3 engine manages it."""
    return _OWNERS.get(p)


def register_external(module: torch.nn.Module, p: torch.nn.Parameter) -> None:
    """``module``'s forward uses ``p``, which another module owns."""
    external = _EXTERNAL.setdefault(module, [])
    if not any(q is p for q in external):
        external.append(p)


def external_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(_EXTERNAL.get(module, ()))


def order_of(p: torch.Tensor) -> int | None:
    """``p``'s number in the order stage 3 met it (its engine's units; before an engine holds it, its latest
    slice): every rank runs the same program, so the numbers agree across ranks and collectives over several
    parameters can go in one order (DeepSpeed's ``ds_id``). A slice's number lives in its entry, not in a map of
    its own: a weak reference to a parameter would stop `torch.utils.swap_tensors`, which materialising needs."""
    if p in _ORDER:
        return _ORDER[p]
    entry = _SLICES.get(p)
    return None if entry is None else entry[1]


def set_slice(p: torch.Tensor, state: tuple) -> None:
    _SLICES[p] = (state, next(_NEXT))


def slice_of(p: torch.Tensor) -> tuple | None:
    entry = _SLICES.get(p)
    return None if entry is None else entry[0]


def pop_slice(p: torch.Tensor) -> tuple:
    """Remove and return ``p``'s slice state.

    Raises:
        KeyError: ``p`` was not built under `init_sharded` (or its slice was taken already).
    """
    return _SLICES.pop(p)[0]


def set_alias(view: torch.Tensor, target: tuple) -> None:
    """Record that the meta tensor ``view`` is ``target = (parameter, fn)``: ``fn(full values)`` (None: them)."""
    _ALIASES[view] = target


def alias_of(view: torch.Tensor) -> tuple | None:
    """``(parameter, fn)`` recorded for ``view`` by `set_alias`, or None."""
    return _ALIASES.get(view)


def init_depth(module: torch.nn.Module) -> int:
    return _INIT_DEPTH.get(module, 0)


def set_init_depth(module: torch.nn.Module, depth: int) -> None:
    if depth:
        _INIT_DEPTH[module] = depth
    else:
        _INIT_DEPTH.pop(module, None)


def set_leaf(module: torch.nn.Module, leaf: bool) -> None:
    """Mark ``module`` a leaf (DeepSpeed's ``set_z3_leaf_modules``): stage 3 gathers every parameter below it
    as one unit at its forward, and hooks none of its submodules. Read when an engine is built."""
    if leaf:
        _LEAVES[module] = True
    else:
        _LEAVES.pop(module, None)


def is_leaf(module: torch.nn.Module) -> bool:
    return _LEAVES.get(module, False)
