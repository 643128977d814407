"""``deepspeed.utils.z3_leaf_module``: mark modules whose parameters stage 3 gathers as one, at the module's forward
(a mixture-of-experts block whose forward calls only some experts). Kept in zero-offload's stage-3 registry
(`zero_offload.zero.stage3.registry.set_leaf`), never on the module; read when the engine is built, so call it
before ``initialize``, as DeepSpeed's documentation says."""
from __future__ import annotations

import torch

from zero_offload.zero.stage3 import registry

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"]


def _qualified(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _matches(module: torch.nn.Module, wanted) -> bool:
    return any(isinstance(module, w) if isinstance(w, type)
               else type(module).__name__ == w or _qualified(module) == w for w in wanted)


def _set(model: torch.nn.Module, classes, flag: bool, raise_if_not_found: bool) -> list[torch.nn.Module]:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise ValueError(f"leaf_module_classes must be a list of types or names, got {classes}")
    found = [m for m in model.modules() if _matches(m, classes)]
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {type(model).__name__}")
    for m in found:
        registry.set_leaf(m, flag)
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True):
    """Mark every module of ``model`` whose class is in ``leaf_module_classes`` (types, class names or qualified
    names); returns them.

    Raises:
        ValueError: no such module (unless ``raise_if_not_found=False``), or an entry neither a type nor a str.
    """
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True):
    return _set(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    registry.set_leaf(model, flag)


def z3_leaf_module(model: torch.nn.Module) -> bool:
    return registry.is_leaf(model)


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    return False


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if registry.is_leaf(m)]


def _by(model, names, match, raise_if_not_found: bool):
    found, missing = [], []
    for wanted in names:
        hits = [m for n, m in model.named_modules() if match(n, wanted)]
        (found.extend(hits) if hits else missing.append(wanted))
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    for m in found:
        registry.set_leaf(m, True)
    return found, missing


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names, flag: bool = True,
                                raise_if_not_found: bool = True):
    """Mark the modules named in ``module_names`` (``named_modules`` names); returns (found, missing names)."""
    return _by(model, module_names, lambda n, w: n == w, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes, flag: bool = True,
                                  raise_if_not_found: bool = True):
    """Mark the modules whose names end with one of ``module_name_suffixes``; returns (found, missing suffixes)."""
    return _by(model, module_name_suffixes, lambda n, w: n.endswith(w), raise_if_not_found)
