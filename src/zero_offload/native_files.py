"""Finding the C libraries that setup.py builds at install time (loaded with ctypes; no Python headers used).

The loaders (`zero_offload.optim._native`, `zero_offload.nvme._native`) use this module; `zero_offload.native`
is the face that asks them which library this process uses.

Two live in the package: the fused host Adam kernel (`zero_offload.optim._native`) and the NVMe swapper's
native AIO path (`zero_offload.nvme._native`). ``ZERO_OFFLOAD_NO_NATIVE=1`` turns both off (their callers fall
back to torch and to ``os.preadv``/``os.pwritev``). `missing_libraries` says which are not built in a package
directory (``benchmarks/gpu_validate.py`` builds them then); `native_available` which this process uses.
"""
from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

__all__ = ["LIBRARIES", "missing_libraries", "native_disabled", "shared_library"]

# name -> (directory relative to the zero_offload package, file stem); setup.py builds each there.
LIBRARIES = {"fused_adam": ("optim/_native", "_fused_adam"), "aio": ("nvme/_native", "_aio")}


def native_disabled() -> bool:
    """True when ``ZERO_OFFLOAD_NO_NATIVE`` is set to anything but "" or "0"."""
    return os.environ.get("ZERO_OFFLOAD_NO_NATIVE", "") not in ("", "0")


def shared_library(directory: Path, stem: str) -> Path | None:
    """The built library ``stem`` + this interpreter's extension suffix in ``directory``, or None if the
    build was skipped or failed (no C compiler)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = directory / f"{stem}{suffix}"
        if candidate.exists():
            return candidate
    return None


def missing_libraries(package: Path | None = None) -> list[str]:
    """Names (keys of `LIBRARIES`) of the native libraries not built for this interpreter in ``package``, a
    ``zero_offload`` package directory (default: this one)."""
    package = Path(__file__).resolve().parent if package is None else Path(package)
    return [name for name, (sub, stem) in LIBRARIES.items() if shared_library(package / sub, stem) is None]
