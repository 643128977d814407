"""Read the ``.pt`` files DeepSpeed writes without DeepSpeed installed and without running code from them.

DeepSpeed pickles some of its own objects into a checkpoint (``LossScaler``/``DynamicLossScaler``,
``ZeroStageEnum``, ``fragment_address``), so ``torch.load(weights_only=True)`` refuses its files and a plain
``torch.load`` needs ``deepspeed`` importable and trusts whatever the file names. `load_pt` unpickles with an
allow-list instead (`safe_pickle` says why): torch's tensor rebuilders, plain containers, numpy arrays and ``argparse.Namespace`` (which
Megatron puts in ``client_state``) load as themselves; each DeepSpeed class loads as a `Foreign` record of
its attributes; anything else fails, naming the file and the class. Tensors are memory-mapped (``mmap=True``)
so that reading one parameter's slice of a rank's partition touches only those pages.

`save_pt` writes the other way: a `Foreign` record pickles as an object of its DeepSpeed class (module and class
named, its attributes as its state), so that DeepSpeed, loading the file, rebuilds its own object
(``DynamicLossScaler`` with our loss scale).
"""
from __future__ import annotations

import contextlib
import copyreg
import os
import pickle
import sys
import threading
import types
import zipfile
from pathlib import Path
from typing import Any

import torch

from zero_offload.checkpoint.io import CheckpointError
from zero_offload.checkpoint.safe_pickle import UntrustedPickleError, pickles_trusted

__all__ = ["Foreign", "foreign_class", "load_pt", "save_pt"]


class Foreign:
    """A DeepSpeed object read without its class: the class's ``module`` and ``name``, the arguments it was rebuilt
    with (``args``: an enum's value, a namedtuple's fields) and its attributes (``state``)."""

    module = name = ""

    def __new__(cls, *args: Any):
        self = object.__new__(cls)
        self.args, self.state = args, {}
        return self

    def __init__(self, *args: Any):
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state if isinstance(state, dict) else {"state": state}

    def __reduce_ex__(self, protocol):
        # What pickle writes for a plain object of DeepSpeed's class: cls.__new__(cls, *args), then its attributes.
        return copyreg.__newobj__, (type(self), *self.args), dict(self.state) or None

    def __getattr__(self, key: str) -> Any:
        state = self.__dict__.get("state", {})
        if key in state:
            return state[key]
        raise AttributeError(f"{type(self).name or 'Foreign'} has no attribute {key!r}")

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}(args={self.args}, state={self.state})"


def foreign_class(module: str, name: str) -> type[Foreign]:
    """The `Foreign` subclass standing for DeepSpeed's ``module.name``."""
    return type(name, (Foreign,), {"module": module, "name": name, "__module__": module, "__qualname__": name})


_ALLOWED = {
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "slice"), ("builtins", "complex"), ("builtins", "bytearray"), ("argparse", "Namespace"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
}
_TORCH_PREFIXES = ("torch._utils", "torch.storage", "torch._tensor")


class _Refused(pickle.UnpicklingError):
    """A name outside the allow-list (carried out of torch.load to become an `UntrustedPickleError`)."""


class _Unpickler(pickle.Unpickler):
    """find_class with an allow-list (every name, where the user trusts the file); DeepSpeed's classes become
    `Foreign` constructors either way, so DeepSpeed need not be installed."""

    def find_class(self, module: str, name: str):
        if module.split(".")[0] == "deepspeed":
            return foreign_class(module, name)
        if (module, name) in _ALLOWED or module.startswith(_TORCH_PREFIXES) or pickles_trusted() or \
                (module == "torch" and (name.endswith("Storage") or isinstance(getattr(torch, name, None),
                                                                              torch.dtype))):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


class _LoadModule:
    """What ``torch.load(pickle_module=...)`` uses: our Unpickler."""
    Unpickler = _Unpickler
    __name__ = "zero_offload.checkpoint.foreign_pickle"

    @staticmethod
    def load(f, **kwargs):
        return _Unpickler(f, **kwargs).load()


def load_pt(path: str | Path) -> Any:
    """The object in ``path`` (a file ``torch.save`` wrote), tensors memory-mapped on the CPU.

    Raises:
        UntrustedPickleError: the file names a class outside the allow-list (the message names the file, the class
            and ``trust_pickles``), unless the caller trusts pickles (`safe_pickle.trusting_pickles`).
        CheckpointError: the file is missing, truncated or damaged.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file '{path}' is missing")
    try:
        mmap = zipfile.is_zipfile(path)          # the legacy (non-zip) format cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=_LoadModule)
    except _Refused as e:
        raise UntrustedPickleError(path, [str(e)]) from None
    except Exception as e:                       # a damaged pickle or archive raises anything
        raise CheckpointError(f"checkpoint file '{path}' cannot be read ({type(e).__name__}: {e}); it is truncated, "
                              f"damaged or not a checkpoint") from e


def _records(obj: Any) -> list[Foreign]:
    """The `Foreign` records inside ``obj`` (dicts, lists and tuples walked)."""
    if isinstance(obj, Foreign):
        return [obj]
    if isinstance(obj, dict):
        return [r for v in obj.values() for r in _records(v)]
    if isinstance(obj, (list, tuple)):
        return [r for v in obj for r in _records(v)]
    return []


_NAMING = threading.Lock()


@contextlib.contextmanager
def _named_as_deepspeed(records: list[Foreign]):
    """Make each record's class importable under its DeepSpeed name while pickling, as pickle requires of a class
    it names (it imports the module and checks the attribute is the class): a stand-in module where DeepSpeed is
    not imported, the record's class set on DeepSpeed's own module where it is (and put back after)."""
    added, replaced = [], []
    with _NAMING:
        try:
            for record in records:
                cls = type(record)
                parts = cls.module.split(".")
                for i in range(1, len(parts) + 1):          # the package and every parent must be importable
                    name = ".".join(parts[:i])
                    if name not in sys.modules:
                        sys.modules[name] = types.ModuleType(name)
                        added.append(name)
                module = sys.modules[cls.module]
                replaced.append((module, cls.name, getattr(module, cls.name, None)))
                setattr(module, cls.name, cls)
            yield
        finally:
            for module, name, old in reversed(replaced):
                if old is None:
                    delattr(module, name)
                else:
                    setattr(module, name, old)
            for name in reversed(added):
                sys.modules.pop(name, None)


def save_pt(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, with every `Foreign` record pickled as an object of its DeepSpeed class (the
    class named, its attributes its state), which DeepSpeed unpickles as its own."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    with _named_as_deepspeed(_records(obj)):
        torch.save(obj, partial)
    os.replace(partial, path)       # a new file: tensors memory-mapped from the old one stay readable
