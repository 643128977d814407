"""Loading a checkpoint: the tag, the manifest that proves itself, every checksum, then a resharding read of
this rank's partitions into fresh tensors before anything in the engine changes (see `zero_offload.checkpoint`
for the layout and the guarantees).
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from zero_offload.checkpoint.io import (CLIENT_STATE, MANIFEST, MODULE_STATE, CheckpointError, agree,
                                        module_state, rank_file, sha256_file)
from zero_offload.checkpoint.manifest import FORMATS, check_tag, validate_manifest, verify_manifest_hash
from zero_offload.checkpoint.safe_pickle import load_torch_file
from zero_offload.checkpoint.reshard import (check_rank_file, check_saved_partitions, reshard_chunks, reshard_runs,
                                             saved_slice)
from zero_offload.runtime.state import STATE_KINDS, CheckpointTarget
from zero_offload.zero.layout import GroupLayout

__all__ = ["load_checkpoint", "read_manifest", "resolve_tag", "full_parameters", "SavedParameters"]

KINDS = STATE_KINDS


# -- load ------------------------------------------------------------------------------------------------
def resolve_tag(load_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """The directory of checkpoint ``tag`` (default: the one ``latest`` names) under ``load_dir``.

    Raises:
        CheckpointError: no such directory, no ``latest`` file, no such tag (the message lists the tags), or a
            tag (given, or read from ``latest``) that is not a plain name inside ``load_dir``.
    """
    root = Path(load_dir)
    if not str(load_dir).strip() or not root.is_dir():
        raise CheckpointError(f"checkpoint directory '{load_dir}' does not exist")
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise CheckpointError(f"no checkpoint in '{root}': '{latest}' does not exist")
        tag = check_tag(latest.read_text().strip(), f"'{latest}'")
    else:
        check_tag(tag, "the tag argument")
    path = root / tag
    if not path.is_dir() and (root / f".replaced-{tag}").is_dir():
        path = root / f".replaced-{tag}"     # a save of the same tag was interrupted mid-swap
    if not path.is_dir():
        tags = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        raise CheckpointError(f"checkpoint tag '{tag}' does not exist in '{root}' (tags there: "
                              f"{', '.join(tags) or 'none'})")
    return path


def read_manifest(directory: Path, verify: list[str] | None = None) -> dict:
    """Read ``directory/manifest.json`` and check the SHA-256 of the files named in ``verify``.

    The manifest's own SHA-256 (``manifest.sha256``, required from format 2 on) and its structure are checked
    first (`manifest`).

    Raises:
        CheckpointError: a missing, unreadable, modified, malformed or foreign manifest, or a missing or
            corrupted file.
    """
    path = directory / MANIFEST
    try:
        data = path.read_bytes()
        manifest = json.loads(data)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file '{path}' is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file '{path}' is corrupted: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS:
        raise CheckpointError(f"checkpoint file '{path}' is not a zero-offload manifest (formats "
                              f"{', '.join(FORMATS)})")
    verify_manifest_hash(directory, data, required=manifest["format"] != "zero-offload/1")
    validate_manifest(manifest, path)
    for name in verify or []:
        file = directory / name
        if name not in manifest["files"]:
            raise CheckpointError(f"checkpoint file '{file}' is not listed in '{path}'")
        if not file.is_file():
            raise CheckpointError(f"checkpoint file '{file}' is missing")
        if sha256_file(file) != manifest["files"][name]:
            raise CheckpointError(f"checkpoint file '{file}' is corrupted: its SHA-256 does not match the "
                                  f"manifest (truncated or modified after saving)")
    return manifest


class SavedParameters:
    """Any saved parameter's full fp32 state, one at a time: ``read(name, kind)`` assembles it from its pieces in
    the rank files (memory-mapped: only its slices are copied). ``names`` lists the parameters in saved order.
    Use it as a context manager (the rank files stay open until it exits).

    Raises (``read``):
        KeyError: a name the checkpoint does not hold.
        CheckpointError: a rank file lacking the group's tensor, or holding it at another size (named).
    """

    def __init__(self, directory: Path, manifest: dict):
        self._directory = directory
        self._groups = manifest["groups"]
        self._where = {p.name: (g, p) for g, group in enumerate(self._groups)
                       for p in GroupLayout.from_json(group).params}
        self._handles: dict[int, Any] = {}
        self.names = list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1].shape)

    def read(self, name: str, kind: str = "master") -> torch.Tensor:
        """Parameter ``name``'s ``kind`` (one of `STATE_KINDS`): fp32, of its shape."""
        g, p = self._where[name]
        out = torch.empty(p.numel, dtype=torch.float32)
        for c in p.pieces:
            path = self._directory / rank_file(c.rank)
            if c.rank not in self._handles:
                self._handles[c.rank] = safe_open(str(path), framework="pt")
            piece = saved_slice(self._handles[c.rank], path, g, kind, self._groups[g]["partition_numel"])
            out[c.param_offset:c.param_offset + c.length] = piece[c.part_offset:c.part_offset + c.length]
        return out.view(p.shape)

    def __enter__(self) -> "SavedParameters":
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()


def full_parameters(directory: Path, manifest: dict, kind: str = "master"):
    """Yield (name, fp32 tensor) for every saved parameter, reading one parameter at a time from the shards
    (peak memory: about the largest parameter, not the model)."""
    with SavedParameters(directory, manifest) as saved:
        for name in saved.names:
            yield name, saved.read(name, kind)


def _check_same_model(engine: CheckpointTarget, manifest: dict, path: Path) -> None:
    saved = {p["name"]: p["shape"] for g in manifest["groups"] for p in g["params"]}
    mine = {p.name: list(p.shape) for g in engine.optimizer_state.layout() for p in g.params}
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    if missing or extra:
        raise CheckpointError(f"checkpoint '{path}' is from another model: parameters missing from it "
                              f"{missing[:5]}, unknown to this model {extra[:5]}")
    for name, shape in mine.items():
        if saved[name] != shape:
            raise CheckpointError(f"checkpoint '{path}' is from another model: parameter '{name}' has shape "
                                  f"{saved[name]} there and {shape} here")


def load_checkpoint(engine: CheckpointTarget, load_dir: str | os.PathLike, tag: str | None = None) -> Any:
    """Restore what `save_checkpoint` wrote, resharding to this engine's world size and stage.

    Optimizer states, master weights, the 16-bit parameters, the step counters, the loss scaler and the LR
    schedule are restored exactly; RNG states too when the world size is the same. Returns the saved
    ``client_state``. A collective: every rank must call it.

    Raises:
        CheckpointError: a missing directory, tag or file, a corrupted file, or a checkpoint of another
            model. Nothing in the engine or on disk is changed then.
    """
    error, staged = None, None
    try:
        staged = _read_for_load(engine, load_dir, tag)
    except CheckpointError as e:
        error = e
    agree(engine, error, "loading the checkpoint")
    manifest, new_states, client_state, rng, saved_module_state = staged
    # Everything is read and checked on every rank: only now change the engine.
    opt = engine.optimizer_state
    for g, state in enumerate(new_states):     # both readers stream: {"step", "chunks"}
        opt.load_state_chunks(g, state["step"], state["chunks"])
    live = module_state(engine.module)
    sharded = opt.frozen_shapes()            # stage-3 frozen parameters: each rank writes its shard
    with torch.no_grad():
        for name, value in saved_module_state.items():
            if name not in sharded:
                live[name].copy_(value)
    opt.load_frozen_state({k: v for k, v in saved_module_state.items() if k in sharded})
    opt.after_load()
    engine.load_state_dict(manifest["engine"])
    if rng is not None:
        _restore_rng(*rng)
    return client_state


def _read_for_load(engine: CheckpointTarget, load_dir, tag):
    """Read and verify everything this rank needs; returns (manifest, partitions, client_state, rng)."""
    directory = resolve_tag(load_dir, tag)
    manifest = read_manifest(directory)
    _check_same_model(engine, manifest, directory / MANIFEST)
    same_world = manifest["world_size"] == engine.world_size
    own = [rank_file(engine.rank)] if same_world else []
    opt = engine.optimizer_state
    if manifest["partitions"] == opt.partitions_count and \
            manifest["groups"] == [g.to_json() for g in opt.layout()]:
        # Same layout: this rank's partition is stored whole in one file; read (and verify) only that.
        shard = rank_file(engine.rank if opt.partitions_count > 1 else 0)
        read_manifest(directory, sorted({shard, *own, CLIENT_STATE}))
        new_states = _read_own_partition(directory / shard, manifest["groups"])
        with safe_open(str(directory / shard), framework="pt") as f:
            _check_state_format(f, directory / shard, engine)
    else:
        shards = [rank_file(r) for r in range(manifest["partitions"])]
        read_manifest(directory, sorted(set(shards + own + [CLIENT_STATE])))
        new_states = _reshard(engine, directory, manifest)
    client_state = load_torch_file(directory / CLIENT_STATE)      # through the allow-list (safe_pickle)
    rng = _read_rng(directory / rank_file(engine.rank)) if same_world else None
    return manifest, new_states, client_state, rng, _read_module_state(engine, directory, manifest)


def _read_module_state(engine: CheckpointTarget, directory: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The saved buffers and frozen parameters, checked against the model's."""
    if MODULE_STATE not in manifest["files"]:
        return {}
    read_manifest(directory, [MODULE_STATE])
    from safetensors.torch import load_file
    saved = load_file(str(directory / MODULE_STATE))
    live = {k: tuple(v.shape) for k, v in module_state(engine.module).items()}
    live.update(engine.optimizer_state.frozen_shapes())
    for name, value in saved.items():
        if name not in live or live[name] != tuple(value.shape):
            raise CheckpointError(f"checkpoint file '{directory / MODULE_STATE}' holds buffer or frozen "
                                  f"parameter '{name}' {tuple(value.shape)} that this model "
                                  f"{'lacks' if name not in live else f'has as {live[name]}'}")
    return saved


def _read_own_partition(path: Path, groups: list[dict]) -> list[dict]:
    """Each group's saved partition in one rank file (checkpoint of the same layout): its step count and its
    state as chunks read lazily from the file (``chunks``), checked here for presence and shape only, so that
    loading never holds a rank's whole state in memory."""
    with safe_open(str(path), framework="pt") as f:
        steps = _steps(f, path, len(groups))
        check_rank_file(f, path, groups)
    return [{"step": steps[g], "chunks": _partition_chunks(path, g, group["partition_numel"])}
            for g, group in enumerate(groups)]


def _partition_chunks(path: Path, g: int, numel: int, chunk_numel: int = 1 << 20):
    """Yield (offset, {kind: fp32 tensor}) pieces of group ``g``'s saved partition, read slice by slice."""
    with safe_open(str(path), framework="pt") as f:
        slices = {kind: saved_slice(f, path, g, kind, numel) for kind in KINDS}
        for lo in range(0, numel, chunk_numel):
            yield lo, {kind: piece[lo:lo + chunk_numel] for kind, piece in slices.items()}


def _check_state_format(handle, path: Path, engine: CheckpointTarget) -> None:
    """The moment slots must mean the same here as when saved (Adam's moments vs SGD's momentum, ...)."""
    saved = (handle.metadata() or {}).get("state_format", "adam")
    mine = engine.optimizer_state.state_format()
    if saved != mine:
        raise CheckpointError(f"checkpoint file '{path}' holds optimizer states of the form {saved!r}, this "
                              f"engine's optimizer keeps {mine!r}: load it with the optimizer type it was saved "
                              f"with")


def _steps(handle, path: Path, groups: int) -> list[int]:
    try:
        steps = json.loads((handle.metadata() or {})["steps"])
    except (KeyError, json.JSONDecodeError):
        raise CheckpointError(f"checkpoint file '{path}' lacks its optimizer step counts") from None
    if not isinstance(steps, list) or len(steps) != groups or \
            not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
        raise CheckpointError(f"checkpoint file '{path}' holds step counts {steps!r} for {groups} param groups")
    return steps


def _reshard(engine: CheckpointTarget, directory: Path, manifest: dict) -> list[dict]:
    """This rank's new partition of each group as its step count and a stream of pieces read slice by slice
    from the saved ranks' files (`reshard`), checked here for format, step counts, presence and
    shapes only: the load never holds a rank's whole partition in memory."""
    zero = engine.optimizer_state
    steps = set()
    for r in range(manifest["partitions"]):
        with safe_open(str(directory / rank_file(r)), framework="pt") as f:
            _check_state_format(f, directory / rank_file(r), engine)
            steps.update(_steps(f, directory / rank_file(r), len(manifest["groups"])))
    if len(steps) > 1:
        raise CheckpointError(f"checkpoint '{directory}' holds different optimizer step counts {sorted(steps)}")
    check_saved_partitions(directory, manifest)
    step = steps.pop() if steps else 0
    rank = engine.rank if zero.partitions_count > 1 else 0
    saved = [GroupLayout.from_json(group) for group in manifest["groups"]]
    return [{"step": step, "chunks": reshard_chunks(directory, manifest, reshard_runs(saved, group, rank),
                                                    group.partition_numel)}
            for group in zero.layout()]


def _read_rng(path: Path):
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        torch_rng = f.get_tensor("rng.torch")
        cuda_rng = f.get_tensor("rng.cuda") if "rng.cuda" in f.keys() else None
    return torch_rng, cuda_rng, json.loads(meta["python_rng"]), json.loads(meta["numpy_rng"])


def _restore_rng(torch_rng, cuda_rng, python_rng, numpy_rng) -> None:
    torch.set_rng_state(torch_rng)
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng)
    version, state, gauss = python_rng
    random.setstate((version, tuple(state), gauss))
    np.random.set_state((numpy_rng[0], np.array(numpy_rng[1], dtype=np.uint32), int(numpy_rng[2]),
                         int(numpy_rng[3]), float(numpy_rng[4])))
