"""Finding the C libraries that setup.py builds at install time (loaded with ctypes; no Python headers used).

Two live in the package: the fused host Adam kernel (`zero_offload.optim._native`) and the NVMe swapper's
native AIO path (`zero_offload.nvme._native`). ``ZERO_OFFLOAD_NO_NATIVE=1`` turns both off (their callers fall
back to torch and to ``os.preadv``/``os.pwritev``).
"""
from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

__all__ = ["native_disabled", "shared_library"]


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
