"""A checkpoint's manifest that proves itself: its SHA-256 sidecar, its structure, and plain tag names.

The manifest (``tag/manifest.json``) holds every file's SHA-256, so a damaged shard is caught; the manifest
itself is covered by ``tag/manifest.sha256``, written before the checkpoint is published and checked before
anything else is read. `validate_manifest` then checks the structure (format, required sections, types,
every piece inside its partition and its parameter) so that a malformed or edited manifest fails with one
clear error before the engine changes, never with a KeyError or a shape error half-way through a load.
"""
from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

from zero_offload.checkpoint.io import CheckpointError

__all__ = ["FORMAT", "FORMATS", "MANIFEST_HASH", "ManifestError", "check_tag", "manifest_digest",
           "validate_manifest", "verify_manifest_hash"]

FORMAT = "zero-offload/2"                    # 2: manifest.sha256 sidecar required
FORMATS = ("zero-offload/1", FORMAT)         # 1 (no sidecar) still loads, with full structural checks
MANIFEST_HASH = "manifest.sha256"
ENGINE_KEYS = ("global_step", "skipped_steps", "micro_steps", "loss_scaler", "lr_scheduler", "lrs")
_TAG = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*")


class ManifestError(CheckpointError):
    """A manifest that is tampered with, malformed, or names a file outside its checkpoint."""


def check_tag(tag: object, where: str) -> str:
    """``tag`` if it is a plain name inside the checkpoint directory (letters, digits, '_', '-', '.', not
    starting with '.'), else ManifestError naming ``where`` it came from."""
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or len(tag) > 200:
        raise ManifestError(f"checkpoint tag {tag!r} from {where} must be a plain name inside the checkpoint "
                            f"directory (letters, digits, '_', '-', '.'; not starting with '.')")
    return tag


def manifest_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verify_manifest_hash(directory: Path, data: bytes, required: bool) -> None:
    """Check ``data`` (the manifest's bytes) against ``directory/manifest.sha256``.

    Raises:
        ManifestError: the sidecar is missing (when ``required``) or does not match.
    """
    sidecar = directory / MANIFEST_HASH
    if not sidecar.is_file():
        if required:
            raise ManifestError(f"checkpoint file '{sidecar}' is missing: the manifest cannot be verified")
        return
    expected = sidecar.read_text().split()[0] if sidecar.read_text().strip() else ""
    if manifest_digest(data) != expected:
        raise ManifestError(f"checkpoint file '{directory / 'manifest.json'}' was modified after saving: its "
                            f"SHA-256 does not match '{sidecar}'")


def _int(value, path: str, lo: int = 0, hi: float = math.inf) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ManifestError(f"'{path}' must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _need(obj, key: str, kind, path: str):
    if not isinstance(obj, dict) or key not in obj:
        raise ManifestError(f"'{path}.{key}' is missing" if path else f"'{key}' is missing")
    value = obj[key]
    if kind is not None and not isinstance(value, kind):
        raise ManifestError(f"'{path + '.' if path else ''}{key}' must be {getattr(kind, '__name__', kind)}, got "
                            f"{type(value).__name__}")
    return value


def _number(value, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ManifestError(f"'{path}' must be a finite number, got {value!r}")
    return value


def validate_manifest(m: object, source: Path) -> dict:
    """Check the structure of manifest ``m`` read from ``source``; returns it.

    Raises:
        ManifestError: the first problem, naming ``source`` and the key path.
    """
    try:
        _validate(m)
    except ManifestError as e:
        raise ManifestError(f"checkpoint file '{source}' is malformed: {e}") from None
    return m


def _validate(m) -> None:
    if not isinstance(m, dict):
        raise ManifestError("the manifest is not a JSON object")
    fmt = _need(m, "format", str, "")
    if fmt not in FORMATS:
        raise ManifestError(f"'format' is {fmt!r}, this version reads {', '.join(FORMATS)}")
    _int(_need(m, "world_size", int, ""), "world_size", 1)
    partitions = _int(_need(m, "partitions", int, ""), "partitions", 1)
    _int(_need(m, "stage", int, ""), "stage", 0, 3)
    _need(m, "precision", str, "")
    _need(m, "config", dict, "")
    files = _need(m, "files", dict, "")
    for name, digest in files.items():
        if not _TAG.fullmatch(name) or not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ManifestError(f"'files' entry {name!r}: {digest!r} is not a plain file name with a SHA-256")
    for r in range(partitions):
        if f"rank{r:05d}.safetensors" not in files:
            raise ManifestError(f"'files' lacks rank{r:05d}.safetensors of partition {r}")
    groups = _need(m, "groups", list, "")
    names = set()
    for g, group in enumerate(groups):
        _validate_group(group, f"groups[{g}]", partitions, names)
    engine = _need(m, "engine", dict, "")
    for key in ENGINE_KEYS:
        _need(engine, key, None, "engine")
    for key in ("global_step", "skipped_steps", "micro_steps"):
        _int(engine[key], f"engine.{key}")
    lrs = _need(engine, "lrs", list, "engine")
    if len(lrs) != len(groups):
        raise ManifestError(f"'engine.lrs' has {len(lrs)} learning rates for {len(groups)} param groups")
    for i, lr in enumerate(lrs):
        _number(lr, f"engine.lrs[{i}]")
    scaler = _need(engine, "loss_scaler", dict, "engine")
    for key in ("scale", "hysteresis", "iteration", "last_overflow_iteration"):
        _number(_need(scaler, key, None, "engine.loss_scaler"), f"engine.loss_scaler.{key}")
    if engine["lr_scheduler"] is not None:
        sched = _need(engine, "lr_scheduler", dict, "engine")
        # DeepSpeed's schedules count last_batch_iteration; a torch LRScheduler (a client's or transformers'
        # Trainer's own schedule) counts last_epoch.
        key = "last_epoch" if "last_epoch" in sched and "last_batch_iteration" not in sched \
            else "last_batch_iteration"
        _number(_need(sched, key, None, "engine.lr_scheduler"), f"engine.lr_scheduler.{key}")


def _validate_group(group, path: str, partitions: int, names: set) -> None:
    part_numel = _int(_need(group, "partition_numel", int, path), f"{path}.partition_numel")
    for i, p in enumerate(_need(group, "params", list, path)):
        where = f"{path}.params[{i}]"
        name = _need(p, "name", str, where)
        if name in names:
            raise ManifestError(f"'{where}.name' {name!r} appears twice")
        names.add(name)
        shape = _need(p, "shape", list, where)
        for d, n in enumerate(shape):
            _int(n, f"{where}.shape[{d}]")
        numel = _int(_need(p, "numel", int, where), f"{where}.numel")
        if numel != math.prod(shape):
            raise ManifestError(f"'{where}.numel' = {numel} does not match its shape {shape}")
        covered = 0
        for j, piece in enumerate(_need(p, "pieces", list, where)):
            at = f"{where}.pieces[{j}]"
            if not isinstance(piece, list) or len(piece) != 4:
                raise ManifestError(f"'{at}' must be [rank, part_offset, param_offset, length]")
            rank, part_offset, param_offset, length = piece
            _int(rank, f"{at}[0] (rank)", 0, partitions - 1)
            _int(part_offset, f"{at}[1] (part_offset)", 0, part_numel)
            _int(length, f"{at}[3] (length)", 1, part_numel - part_offset)
            if param_offset != covered:
                raise ManifestError(f"'{at}[2]' (param_offset) = {param_offset!r}: pieces must cover "
                                    f"'{name}' in order, the next starts at {covered}")
            covered += length
        if covered != numel:
            raise ManifestError(f"the pieces of '{name}' cover {covered} of its {numel} elements")
