"""Pickled checkpoint files read without running code named by the file.

A pickle can name any importable callable and call it while loading (``os.system``, say), so a checkpoint
directory someone downloads could run what its author chose. Every pickle this package reads goes through an
allow-list instead:

- the client state (``client_state.pt``, written by ``torch.save``): torch's own ``weights_only`` unpickler, which
  loads containers, numbers, strings, bytes, tensors and torch's dtypes, sizes and devices, widened by
  `SAFE_GLOBALS`: numpy arrays, numpy scalars and dtypes, and ``argparse.Namespace`` (Megatron and many training
  scripts keep their arguments in it);
- DeepSpeed's ``.pt`` files: `zero_offload.checkpoint.foreign_pickle` (its own classes become inert records);
- a DCP directory's ``.metadata`` (torch's ``FileSystemReader`` reads it with a plain ``pickle.load``): `dcp_reader`,
  which admits only the metadata classes DCP itself writes.

A file naming anything else is refused with `UntrustedPickleError`, which names the file, the type and the
option for a user who trusts the file: ``trust_pickles=True`` (``Engine.load_checkpoint``) or the config key
``checkpoint.trust_pickles``. DeepSpeed 0.19.8 loads these files with ``weights_only=False`` and so runs them.
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import importlib
import pathlib
import pickle
from pathlib import Path
from typing import Any

import numpy
import functools

import torch

from zero_offload.checkpoint.io import CheckpointError

__all__ = ["SAFE_GLOBALS", "dcp_reader", "UntrustedPickleError", "load_dcp_metadata", "load_torch_file",
           "pickles_trusted", "trusting_pickles"]

TRUST_OPTION = "trust_pickles=True (config key 'checkpoint.trust_pickles')"
# Set by the entry points that take the option (`formats.load_any`, `convert`, the face's zero_to_fp32) for the
# loads they make, so the readers between need not carry it; a context variable, so one thread's choice stays its own.
_TRUSTED = contextvars.ContextVar("zero_offload_trust_pickles", default=False)


@contextlib.contextmanager
def trusting_pickles(trust: bool):
    """Within the block, pickled checkpoint files load by the full unpickler when ``trust`` is true (the user's
    ``trust_pickles``), else through the allow-list."""
    token = _TRUSTED.set(bool(trust))
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def pickles_trusted() -> bool:
    """Whether the enclosing `trusting_pickles` block trusts pickles (False outside any)."""
    return _TRUSTED.get()


class UntrustedPickleError(CheckpointError):
    """A pickled checkpoint file names a type outside the allow-list; nothing from it was run or loaded."""

    def __init__(self, path: Path | str, names: list[str]):
        self.path, self.names = Path(path), list(names)
        super().__init__(f"checkpoint file '{path}' names {', '.join(self.names)}, outside the allow-list of the data "
                         f"types a checkpoint may hold; unpickling it could run code the file chose, so it was "
                         f"refused and nothing was loaded. If you trust this file, load it with {TRUST_OPTION}")


def _numpy_globals() -> list:
    # numpy's own names for rebuilding arrays and scalars, under numpy 2's module and numpy 1's (files written with
    # either load with either); torch's weights_only docs name these.
    multiarray = importlib.import_module("numpy._core.multiarray")
    rebuild, scalar = multiarray._reconstruct, multiarray.scalar
    dtypes = [t for t in vars(numpy.dtypes).values() if isinstance(t, type) and issubclass(t, numpy.dtype)]
    return [numpy.ndarray, numpy.dtype, rebuild, scalar, (rebuild, "numpy.core.multiarray._reconstruct"),
            (scalar, "numpy.core.multiarray.scalar"), *dtypes]


SAFE_GLOBALS = [argparse.Namespace, *_numpy_globals()]


def load_torch_file(path: Path | str) -> Any:
    """The object ``torch.save`` wrote to ``path``, on the CPU, loaded through the allow-list (module docstring);
    inside ``trusting_pickles(True)`` by torch's full unpickler (``weights_only=False``, DeepSpeed's way).

    Raises:
        UntrustedPickleError: the file names a type outside the allow-list (and pickles are not trusted).
        CheckpointError: the file is missing, truncated or damaged.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file '{path}' is missing")
    try:
        if pickles_trusted():
            return torch.load(path, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _refused_names(path)
        if refused:
            raise UntrustedPickleError(path, refused) from None
        raise _damaged(path, e) from e
    except Exception as e:                       # a damaged archive raises anything
        raise _damaged(path, e) from e


def _refused_names(path: Path) -> list[str]:
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):      # what torch would still refuse
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:                            # not a readable archive: damaged, not refused
        return []


def _damaged(path: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"checkpoint file '{path}' cannot be read ({type(e).__name__}: {e}); it is truncated, "
                           f"damaged or not a checkpoint")


_DCP_METADATA = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """The classes DCP writes into ``.metadata``, torch's dtypes, and nothing else."""

    path: Path = Path()

    def find_class(self, module: str, name: str):
        if name in _DCP_METADATA.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedPickleError(self.path, [f"{module}.{name}"])


def load_dcp_metadata(path: Path | str) -> Any:
    """The ``Metadata`` object in a DCP ``.metadata`` file, unpickled through the allow-list above.

    Raises:
        UntrustedPickleError: the file names anything but DCP's metadata classes (pickles not trusted).
        CheckpointError: the file is missing or damaged.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if pickles_trusted():
                return pickle.load(f)
            unpickler = _MetadataUnpickler(f)
            unpickler.path = path
            return unpickler.load()
    except CheckpointError:
        raise
    except Exception as e:
        raise _damaged(path, e) from e


def dcp_reader(path: str | pathlib.Path):
    """torch's ``FileSystemReader`` for the DCP directory ``path``, with its metadata read through
    `load_dcp_metadata` (the tensors themselves torch reads with ``weights_only=True``)."""
    return _reader_class()(path)


@functools.cache
def _reader_class() -> type:
    # Built on first use: importing torch.distributed.checkpoint costs a second that most runs never need.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class AllowListReader(FileSystemReader):
        def __init__(self, path: str | pathlib.Path):
            super().__init__(str(path))
            self.directory = Path(path)

        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = load_dcp_metadata(self.directory / ".metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
    return AllowListReader
