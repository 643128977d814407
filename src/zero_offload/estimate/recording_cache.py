"""The step model's recordings kept on disk, so that a second launch plans without recording again.

A recording (`zero_offload.estimate.proxy_recording.recording`) is what the engine's code does for a structure;
a cold plan records about fifty of them. Each is stored as JSON in ``$ZERO_OFFLOAD_RECORDINGS_DIR`` (default
``~/.cache/zero_offload/recordings``, beside the calibration file), named by a hash of the structure, the source
of this package (every ``.py``, ``.cpp`` and ``.h`` file: the engine that recorded it, and the proxy) and torch's
and Python's versions, so that a changed engine never reads an older engine's recording.
``ZERO_OFFLOAD_RECORDINGS_DIR=off`` keeps none. The recordings of the `KEEP_ENGINES` engines that wrote last are
kept, older ones deleted (53 files, 9 MB, per engine for a GPT-2 plan).

A file that cannot be read back is recorded again and replaced; a directory that cannot be written is passed over
(the plan is the same, made slower). A recording is written to a temporary file and renamed, so ranks that
record at once never read a torn one.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

__all__ = ["DIR_ENV", "KEEP_ENGINES", "recordings_dir", "load", "store"]

DIR_ENV = "ZERO_OFFLOAD_RECORDINGS_DIR"
_OFF = ("off", "0", "none", "false", "no")
_SOURCES = (".py", ".cpp", ".h")
KEEP_ENGINES = 4          # the engines (code digests) whose recordings are kept: an upgrade, or a developer's edits


def recordings_dir() -> Path | None:
    """Where recordings are kept: ``$ZERO_OFFLOAD_RECORDINGS_DIR``, else ``~/.cache/zero_offload/recordings``;
    None when the variable says ``off``."""
    raw = os.environ.get(DIR_ENV, "").strip()
    if raw.lower() in _OFF:
        return None
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "zero_offload" / "recordings"


@functools.cache
def _code_digest() -> str:
    package = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(f"{torch.__version__} {sys.version_info[:2]}".encode())
    for path in sorted(p for p in package.rglob("*") if p.suffix in _SOURCES and "__pycache__" not in p.parts):
        h.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _path(key: dict) -> Path | None:
    where = recordings_dir()
    if where is None:
        return None
    structure = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return where / f"{_code_digest()[:16]}-{structure}.json"


def _forget_old_engines(where: Path) -> None:
    """Delete the recordings of all but the `KEEP_ENGINES` engines (code digests) written last."""
    latest: dict[str, float] = {}
    files = list(where.glob("*-*.json"))
    for f in files:
        engine = f.name.split("-")[0]
        latest[engine] = max(latest.get(engine, 0.0), f.stat().st_mtime)
    kept = set(sorted(latest, key=latest.__getitem__)[-KEEP_ENGINES:])
    for f in files:
        if f.name.split("-")[0] not in kept:
            f.unlink(missing_ok=True)


def load(key: dict) -> dict | None:
    """The recording stored for ``key`` (a structure as a dict) by this code, or None: none stored, the cache
    off, or a file that does not read back as a recording."""
    path = _path(key)
    try:
        raw = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("key") != key or not isinstance(raw.get("recording"), dict):
        return None
    return raw["recording"]


def store(key: dict, recording: dict) -> None:
    """Keep ``recording`` for ``key``; passed over where the directory cannot be written."""
    path = _path(key)
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
            json.dump({"key": key, "recording": recording}, f)
        os.replace(tmp, path)
        _forget_old_engines(path.parent)
    except OSError:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
