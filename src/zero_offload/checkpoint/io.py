"""Checkpoint file names and I/O: checksums, fsync, write errors that name the file and the bytes needed, and
agreement among ranks on a failure."""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError

from zero_offload.comm import gather_objects

__all__ = ["CheckpointError", "DiskFullError", "sha256_file", "fsync_path", "write_errors", "module_state",
           "rank_file", "agree", "MANIFEST", "CLIENT_STATE", "MODULE_STATE", "TMP_PREFIX"]

MANIFEST = "manifest.json"
CLIENT_STATE = "client_state.pt"
MODULE_STATE = "module_state.safetensors"
TMP_PREFIX = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; the message names the directory, file or tag at fault."""


class DiskFullError(CheckpointError, OSError):
    """No space left on the device while writing a checkpoint file; names the file and the bytes needed."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _free_bytes(path: Path) -> int | None:
    for p in (path.parent, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


@contextmanager
def write_errors(path: Path, need_bytes: int, what: str = "checkpoint file",
                 only_disk_full: bool = False) -> Iterator[None]:
    """Turn a failed write of ``path`` (about ``need_bytes`` long) into an error that a person can act on.

    safetensors reports a full disk as ``SafetensorError`` and ``torch.save`` as ``basic_ios::clear:
    iostream error``, neither naming the file; here a full disk becomes `DiskFullError` naming ``what`` and
    ``path``, the bytes it needs and the bytes free. Any other write error becomes a `CheckpointError` naming
    the file, or passes unchanged with ``only_disk_full``.
    """
    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as e:
        if isinstance(e, CheckpointError):
            raise
        free = _free_bytes(path)
        full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e) or \
            (not isinstance(e, FileNotFoundError) and free is not None and free < need_bytes)
        if full:
            raise DiskFullError(f"no space left on the device to write {what} '{path}': it needs about "
                                f"{need_bytes} bytes ({need_bytes / 2**20:.1f} MiB), {free} bytes are free "
                                f"there; free space or write elsewhere") from e
        if only_disk_full:
            raise
        raise CheckpointError(f"could not write {what} '{path}': {e}") from e


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the optimizer does not hold: persistent buffers and frozen parameters, by qualified name."""
    out = {}
    for prefix, m in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[dot + name] = b
        for name, p in m._parameters.items():
            if p is not None and not p.requires_grad:
                out[dot + name] = p.data
    return out


@contextmanager
def staged_directory(final: Path, what: str) -> Iterator[Path]:
    """A fresh temporary directory beside ``final`` to write into (``what`` names the writer in its name); when the
    block ends without an error it replaces ``final`` (an old ``final`` is moved aside first and removed last, so a
    crash leaves it whole), and on an error it is removed and ``final`` is untouched."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".tmp-{what}-{final.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replaced = final.parent / f".replaced-{what}-{final.name}"
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    staging.rename(final)
    shutil.rmtree(replaced, ignore_errors=True)


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def agree(engine, error: Exception | None, what: str) -> None:
    """Raise on every rank if ``what`` failed on any rank, so that no rank goes on into a collective alone.
    The rank that failed raises its own error; the others name the first failing rank and its message."""
    if engine.world_size > 1:
        errors = gather_objects(None if error is None else str(error))
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if error is None and failed:
            rank, message = failed[0]
            raise CheckpointError(f"{what} failed on another rank ({rank}); nothing was changed: {message}")
    if error is not None:
        raise error
