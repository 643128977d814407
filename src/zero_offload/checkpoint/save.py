"""Saving a checkpoint: one writer per directory, unique temporary names, atomic publication, pruning.

See `zero_offload.checkpoint` for the layout on disk and the guarantees.
"""
from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from zero_offload.checkpoint.io import (CLIENT_STATE, MANIFEST, MODULE_STATE, TMP_PREFIX, CheckpointError, agree,
                                        fsync_path, module_state, rank_file, sha256_file, write_errors)
from zero_offload.checkpoint.lock import DirectoryLock, LockedError
from zero_offload.checkpoint.stream import StreamedSafetensors
from zero_offload.checkpoint.manifest import FORMAT, MANIFEST_HASH, ManifestError, check_tag, manifest_digest
from zero_offload.comm import broadcast_object, gather_objects
from zero_offload.runtime.state import STATE_KINDS, CheckpointTarget

__all__ = ["save_checkpoint", "list_tags", "prune_checkpoints", "tied_aliases"]

KINDS = STATE_KINDS
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def _fault_point(name: str) -> None:
    """Fault injection for the crash-safety tests: SIGKILL this process at the named point of a save when
    ZERO_OFFLOAD_KILL_AT names it."""
    if os.environ.get("ZERO_OFFLOAD_KILL_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """{state_dict name: the first name of the same tensor} for every tied alias (GPT-2's ``lm_head.weight``
    tied to ``transformer.wte.weight``)."""
    first: dict[int, str] = {}
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in first:
            out[name] = first[id(t)]
        else:
            first[id(t)] = name
    return out


def save_checkpoint(engine: CheckpointTarget, save_dir: str | os.PathLike, tag: str | None = None,
                    client_state: Any = None) -> Path:
    """Write the engine's full training state under ``save_dir/tag`` (see the module docstring).

    A collective: every rank must call it with the same arguments. ``tag`` defaults to
    ``global_step{N}`` as in DeepSpeed. Returns the checkpoint directory.

    Raises:
        CheckpointError: an empty ``save_dir``, a tag that is not a plain name, another process saving into
            ``save_dir`` (names its pid), or a failed write (`DiskFullError` names the file and the bytes it
            needs). The previous checkpoints and ``latest`` are untouched then, on every rank.
    """
    if save_dir is None or not str(save_dir).strip():
        raise CheckpointError(f"save_checkpoint needs a directory, got {save_dir!r}")
    tag = tag if tag is not None else f"global_step{engine.global_step}"
    try:
        check_tag(tag, "save_checkpoint(tag=...)")
    except ManifestError as e:
        raise CheckpointError(str(e)) from None
    root = Path(save_dir)
    lock, tmp, error = None, None, None
    if engine.rank == 0:
        try:
            lock = DirectoryLock(root, "being saved into").acquire()
            _remove_stale_tmp(root)
            tmp = root / f"{TMP_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(4)}"
            tmp.mkdir()
        except (LockedError, OSError) as e:
            error = CheckpointError(f"cannot save checkpoint '{tag}': {e}")
    try:
        name = broadcast_object(tmp.name if tmp is not None else None)
        if name is None:
            agree(engine, error, f"saving checkpoint '{tag}' into '{root}'")
            raise CheckpointError(f"cannot save checkpoint '{tag}' into '{root}' (see rank 0's error)")
        tmp = root / name
        _write_all(engine, root, tmp, tag, client_state)
    except BaseException:
        if engine.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.release()
    return root / tag


def _remove_stale_tmp(root: Path) -> None:
    """Remove temporary folders of saves that died (we hold the lock: no live save owns one)."""
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _write_all(engine: CheckpointTarget, root: Path, tmp: Path, tag: str, client_state: Any) -> None:
    error, digests = None, {}
    # Stage 3 holds frozen parameters sharded: gathered (a collective) into rank 0's module state file, whole,
    # so that any world size and stage reads them back.
    frozen = engine.optimizer_state.frozen_state(every_rank=False)
    try:
        digests = _write_shard(engine, tmp)
    except (CheckpointError, NotImplementedError) as e:   # every rank learns of it: none waits alone
        error = e
    if engine.world_size > 1:
        digests = {k: v for d in gather_objects(digests) for k, v in d.items()}
    agree(engine, error, f"writing checkpoint '{tag}'")
    error = None
    if engine.rank == 0:
        try:
            _write_rank0_files(engine, root, tmp, tag, client_state, digests, frozen)
        except CheckpointError as e:
            error = e
    agree(engine, error, f"writing checkpoint '{tag}'")


def _write_shard(engine: CheckpointTarget, tmp: Path) -> dict[str, str]:
    """This rank's file: its RNG states and its partition state, streamed chunk by chunk from the optimizer
    (`state_chunks`) into place in the file, so the state is never whole in memory (NVMe swap files)."""
    opt = engine.optimizer_state
    fixed: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        fixed["rng.cuda"] = torch.cuda.get_rng_state()
    layout = opt.layout() if engine.rank < opt.partitions_count else []
    steps = [opt.group_step(g) for g in range(len(layout))]
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in fixed.items()}
    for g, group in enumerate(layout):
        specs.update({f"group{g}.{kind}": (torch.float32, (group.partition_numel,)) for kind in KINDS})
    np_state = np.random.get_state()
    metadata = {"steps": json.dumps(steps), "state_format": opt.state_format(),
                "python_rng": json.dumps(random.getstate()),
                "numpy_rng": json.dumps([np_state[0], np_state[1].tolist(), *map(float, np_state[2:])])}
    path = tmp / rank_file(engine.rank)
    need = _nbytes(fixed) + sum(3 * 4 * group.partition_numel for group in layout) + 4096
    try:
        with write_errors(path, need):
            out = StreamedSafetensors(path, specs, metadata)
            try:
                for name, t in fixed.items():
                    out.write(name, 0, t)
                for g in range(len(layout)):
                    for lo, piece in _reading(lambda g=g: opt.state_chunks(g)):
                        for kind in KINDS:
                            out.write(f"group{g}.{kind}", lo, piece[kind].float())
            except BaseException:
                out.abort()
                raise
            out.close()
            _fault_point("shard_written")
            fsync_path(path)
    except _ReadError as e:      # reading the state failed (an NVMe I/O error), not writing the file
        raise e.error from e.error.__cause__
    return {path.name: sha256_file(path)}


class _ReadError(Exception):
    """Carries an error of the state source past `write_errors`, which is about the checkpoint file only."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _reading(make_chunks):
    """The pieces of ``make_chunks()``, any error from producing them wrapped in `_ReadError`."""
    try:
        iterator = iter(make_chunks())
    except Exception as e:
        raise _ReadError(e) from e
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except Exception as e:
            raise _ReadError(e) from e
        yield item


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _write_rank0_files(engine: CheckpointTarget, root: Path, tmp: Path, tag: str, client_state: Any,
                       digests: dict[str, str], frozen: dict[str, torch.Tensor]) -> None:
    path = tmp / CLIENT_STATE
    with write_errors(path, 1 << 16):
        torch.save(client_state, path)
        fsync_path(path)
    digests[CLIENT_STATE] = sha256_file(path)
    buffers = {k: v.detach().cpu().contiguous().clone() for k, v in module_state(engine.module).items()
               if k not in frozen}
    seen: set[int] = set()
    for k, v in frozen.items():            # a tied alias is its own copy, as module_state's names are above
        buffers[k] = v.clone() if id(v) in seen else v.contiguous()
        seen.add(id(v))
    path = tmp / MODULE_STATE
    with write_errors(path, _nbytes(buffers) + 4096):
        save_file(buffers, str(path))
        fsync_path(path)
    digests[MODULE_STATE] = sha256_file(path)
    data = json.dumps(_manifest(engine, digests), indent=1).encode()
    _fault_point("before_manifest")
    with write_errors(tmp / MANIFEST, len(data) + 64):
        (tmp / MANIFEST).write_bytes(data)
        (tmp / MANIFEST_HASH).write_text(manifest_digest(data) + "\n")
        fsync_path(tmp / MANIFEST)
        fsync_path(tmp / MANIFEST_HASH)
        fsync_path(tmp)
        _publish(root, tmp, root / tag, tag)


def _manifest(engine: CheckpointTarget, digests: dict[str, str]) -> dict:
    opt = engine.optimizer_state
    groups = [g.to_json() for g in opt.layout()]
    return {
        "format": FORMAT, "world_size": engine.world_size, "partitions": opt.partitions_count,
        "stage": opt.stage, "precision": engine.config.precision, "groups": groups, "files": digests,
        "config": engine.config.to_dict(),
        # Every model.state_dict() name in order, and each tied alias's first name (for consolidate).
        "state_dict_keys": list(engine.module.state_dict(keep_vars=True)),
        "aliases": tied_aliases(engine.module),
        "engine": engine.state_dict(),
        # Each group's hyperparameters (the model_parameters groups'), for readers without the model: `convert`.
        "param_groups": [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k in HYPERPARAMETERS}
                         for g in engine.optimizer.param_groups],
    }


def _publish(root: Path, tmp: Path, final: Path, tag: str) -> None:
    """Rename the finished ``tmp`` into place, then point ``latest`` at it; each step is atomic."""
    replaced = root / f".replaced-{tag}"
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)       # if killed now, loading `tag` falls back to `.replaced-tag`
        _fault_point("old_moved_aside")
    os.rename(tmp, final)
    _fault_point("renamed")
    shutil.rmtree(replaced, ignore_errors=True)
    latest_tmp = root / f"{TMP_PREFIX}latest-{os.getpid()}-{secrets.token_hex(4)}"
    latest_tmp.write_text(tag)
    fsync_path(latest_tmp)
    _fault_point("before_latest")
    os.replace(latest_tmp, root / "latest")
    fsync_path(root)


def list_tags(save_dir: str | os.PathLike) -> list[str]:
    """The complete checkpoints under ``save_dir`` (folders with a manifest), oldest first by modification."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    tags = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file()]
    return [p.name for p in sorted(tags, key=lambda p: (p.stat().st_mtime, p.name))]


def prune_checkpoints(save_dir: str | os.PathLike, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints under ``save_dir`` (never the one ``latest``
    names), holding the directory's lock. Returns the removed tags.

    Raises:
        CheckpointError: ``keep_last`` < 1, or another process is saving into ``save_dir``.
    """
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(save_dir)
    try:
        lock = DirectoryLock(root, "being saved into").acquire()
    except LockedError as e:
        raise CheckpointError(f"cannot prune checkpoints: {e}") from None
    try:
        latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
        tags = list_tags(root)
        doomed = [t for t in tags[:max(0, len(tags) - keep_last)] if t != latest]
        for t in doomed:
            shutil.rmtree(root / t)
        return doomed
    finally:
        lock.release()
