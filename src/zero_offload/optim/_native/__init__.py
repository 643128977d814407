"""Loader for the native host kernels (`fused_adam.c`, `accumulate.c`, `muon.c`, built by setup.py as one library,
``_fused_adam``).

The shared library is compiled at install time (``pip install .`` or ``pip install -e .``) and loaded here
with ctypes; nothing is compiled at run time. `load()` returns None when the library is missing or
``ZERO_OFFLOAD_NO_NATIVE=1`` is set; the caller then falls back to torch.
``ZERO_OFFLOAD_ISA=scalar|avx2|avx512`` caps the instruction set the kernel dispatches to (for tests).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from zero_offload.native_files import native_disabled, shared_library

__all__ = ["HParams", "ISA_NAMES", "load", "set_isa", "library_path"]

ISA_NAMES = ("scalar", "avx2", "avx512")
_UNSET = object()
_lib: ctypes.CDLL | None | object = _UNSET
_load_error: str | None = None


class HParams(ctypes.Structure):
    """`zo_hparams` in fused_adam.c: fp32 constants precomputed in Python (double) and rounded once."""

    _fields_ = [(name, ctypes.c_float) for name in (
        "grad_scale", "decay", "l2", "w1", "beta2", "one_minus_beta2", "bc2_sqrt", "eps", "neg_step_size")
    ] + [("flags", ctypes.c_int32), ("prefetch_elems", ctypes.c_int32), ("seed", ctypes.c_uint32),
         ("index_base", ctypes.c_int64)]


def library_path() -> Path | None:
    """The built shared library next to this file, or None if the build was skipped or failed."""
    return shared_library(Path(__file__).parent, "_fused_adam")


def load_error() -> str | None:
    """Why the last `load()` returned None (None if it did not)."""
    return _load_error


def load(reload: bool = False) -> ctypes.CDLL | None:
    """The kernel's library with argument types declared, or None when unavailable or disabled."""
    global _lib, _load_error
    if _lib is not _UNSET and not reload:
        return _lib  # type: ignore[return-value]
    _lib, _load_error = None, None
    if native_disabled():
        _load_error = "disabled by ZERO_OFFLOAD_NO_NATIVE"
        return None
    path = library_path()
    if path is None:
        _load_error = "the native kernel was not built at install time (no C compiler?)"
        return None
    try:
        import torch  # noqa: F401  (loads torch's libgomp first, so the kernel shares its OpenMP runtime)

        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        _load_error = f"could not load {path.name}: {exc}"
        return None
    lib.zo_adam_step.restype = ctypes.c_int
    lib.zo_adam_step.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(HParams), ctypes.c_int,
    ]
    lib.zo_adam_step_from.restype = ctypes.c_int
    lib.zo_adam_step_from.argtypes = lib.zo_adam_step.argtypes + [ctypes.c_void_p] * 3
    lib.zo_set_isa.restype = ctypes.c_int
    lib.zo_set_isa.argtypes = [ctypes.c_int]
    lib.zo_num_threads_max.restype = ctypes.c_int
    lib.zo_accumulate.restype = ctypes.c_int
    lib.zo_accumulate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                  ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    lib.zo_muon_momentum.restype = ctypes.c_int
    lib.zo_muon_momentum.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int]
    lib.zo_muon_update.restype = ctypes.c_int
    lib.zo_muon_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float,
                                   ctypes.c_int, ctypes.c_int]
    want = os.environ.get("ZERO_OFFLOAD_ISA", "")
    lib.zo_set_isa(ISA_NAMES.index(want) if want in ISA_NAMES else -1)
    _lib = lib
    return lib


def set_isa(name: str | None) -> str:
    """Cap the kernel's instruction set ("scalar", "avx2", "avx512"; None: the best available).

    Returns the ISA now in use (never above what the CPU supports). Raises RuntimeError if not built.
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"native kernel unavailable: {_load_error}")
    if name is not None and name not in ISA_NAMES:
        raise ValueError(f"set_isa: name must be one of {ISA_NAMES} or None, got {name!r}")
    return ISA_NAMES[lib.zo_set_isa(-1 if name is None else ISA_NAMES.index(name))]
