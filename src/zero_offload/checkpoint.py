"""Sharded, atomic checkpoints that reshard on load, in safetensors files with a JSON manifest.

Layout of ``save_dir/tag/``:
  ``rank00000.safetensors`` ...  one per rank: its partition of every group's fp32 master weights, exp_avg and
                                 exp_avg_sq (``group{g}.{kind}``; stage 0 has one partition, in rank 0's file),
                                 and its RNG states; the optimizer step count is in the file's metadata.
  ``client_state.pt``            the user's ``client_state`` (torch.save).
  ``module_state.safetensors``   persistent buffers and frozen parameters (what no optimizer holds).
  ``manifest.json``              world size, stage, precision, every parameter's name, shape and flat offset,
                                 each group's partition size, the config, the engine's state, and a SHA-256
                                 of every file.
``save_dir/latest`` names the newest tag.

Crash safety: everything is written into ``save_dir/.tmp-tag``, flushed to disk, and renamed to ``tag`` only
when complete; ``latest`` is replaced last, atomically. A process killed at any moment leaves the previous
checkpoint loadable. Loading checks every checksum, name and shape before it changes anything, and maps
parameters by name from the saved flat layout into the engine's, so a checkpoint written by N ranks at any
stage loads into M ranks at any stage (DeepSpeed needs its universal-checkpoint conversion for that).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from zero_offload.state import STATE_KINDS, CheckpointTarget
from zero_offload.zero.layout import GroupLayout

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "read_manifest", "resolve_tag",
           "full_parameters", "tied_aliases", "MODULE_STATE"]

FORMAT = "zero-offload/1"
KINDS = STATE_KINDS
MANIFEST = "manifest.json"
CLIENT_STATE = "client_state.pt"
MODULE_STATE = "module_state.safetensors"


def _module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
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


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; the message names the directory, file or tag at fault."""


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault_point(name: str) -> None:
    """Fault injection for the crash-safety tests: SIGKILL this process at the named point of a save when
    ZERO_OFFLOAD_KILL_AT names it."""
    if os.environ.get("ZERO_OFFLOAD_KILL_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _barrier(engine: CheckpointTarget) -> None:
    if engine.world_size > 1:
        dist.barrier()


# -- save ------------------------------------------------------------------------------------------------
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


def save_checkpoint(engine: "Engine", save_dir: str | os.PathLike, tag: str | None = None,
                    client_state: Any = None) -> Path:
    """Write the engine's full training state under ``save_dir/tag`` (see the module docstring).

    A collective: every rank must call it with the same arguments. ``tag`` defaults to
    ``global_step{N}`` as in DeepSpeed. Returns the checkpoint directory.

    Raises:
        CheckpointError: a tag that is not a plain file name.
    """
    tag = tag or f"global_step{engine.global_step}"
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", tag) or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain name (letters, digits, '_', '-', '.')")
    root = Path(save_dir)
    tmp, final = root / f".tmp-{tag}", root / tag
    if engine.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(engine)
    opt = engine.optimizer_state
    partitions = opt.partitions_count
    tensors: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    steps = []
    if engine.rank < partitions:
        for g, group in enumerate(opt.layout()):
            steps.append(opt.group_step(g))
            whole = {kind: torch.empty(group.partition_numel, dtype=torch.float32) for kind in KINDS}
            for lo, piece in opt.state_chunks(g):
                for kind in KINDS:
                    whole[kind][lo:lo + piece[kind].numel()] = piece[kind]
            tensors.update({f"group{g}.{kind}": t for kind, t in whole.items()})
    np_state = np.random.get_state()
    metadata = {"steps": json.dumps(steps), "python_rng": json.dumps(random.getstate()),
                "numpy_rng": json.dumps([np_state[0], np_state[1].tolist(), *map(float, np_state[2:])])}
    path = tmp / _rank_file(engine.rank)
    save_file(tensors, str(path), metadata=metadata)
    _fault_point("shard_written")
    _fsync(path)
    digests = {path.name: _sha256(path)}
    if engine.world_size > 1:
        gathered = [None] * engine.world_size
        dist.all_gather_object(gathered, digests)
        digests = {k: v for d in gathered for k, v in d.items()}
    if engine.rank == 0:
        torch.save(client_state, tmp / CLIENT_STATE)
        _fsync(tmp / CLIENT_STATE)
        digests[CLIENT_STATE] = _sha256(tmp / CLIENT_STATE)
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in _module_state(engine.module).items()},
                  str(tmp / MODULE_STATE))
        _fsync(tmp / MODULE_STATE)
        digests[MODULE_STATE] = _sha256(tmp / MODULE_STATE)
        manifest = _manifest(engine, partitions, digests)
        _fault_point("before_manifest")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        _publish(root, tmp, final, tag)
    _barrier(engine)
    return final


def _manifest(engine: CheckpointTarget, partitions: int, digests: dict[str, str]) -> dict:
    opt = engine.optimizer_state
    groups = [g.to_json() for g in opt.layout()]
    return {
        "format": FORMAT, "world_size": engine.world_size, "partitions": partitions, "stage": opt.stage,
        "precision": engine.config.precision, "groups": groups, "files": digests,
        "config": engine.config.to_dict(),
        # Every model.state_dict() name in order, and each tied alias's first name (for consolidate).
        "state_dict_keys": list(engine.module.state_dict(keep_vars=True)),
        "aliases": tied_aliases(engine.module),
        "engine": engine.state_dict(),
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
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(tag)
    _fsync(latest_tmp)
    _fault_point("before_latest")
    os.replace(latest_tmp, root / "latest")
    _fsync(root)


# -- load ------------------------------------------------------------------------------------------------
def resolve_tag(load_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """The directory of checkpoint ``tag`` (default: the one ``latest`` names) under ``load_dir``.

    Raises:
        CheckpointError: no such directory, no ``latest`` file, or no such tag (the message lists the tags).
    """
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory '{root}' does not exist")
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise CheckpointError(f"no checkpoint in '{root}': '{latest}' does not exist")
        tag = latest.read_text().strip()
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

    Raises:
        CheckpointError: a missing, unreadable or foreign manifest, or a missing or corrupted file.
    """
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file '{path}' is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file '{path}' is corrupted: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file '{path}' is not a {FORMAT} manifest")
    for name in verify or []:
        file = directory / name
        if name not in manifest["files"]:
            raise CheckpointError(f"checkpoint file '{file}' is not listed in '{path}'")
        if not file.is_file():
            raise CheckpointError(f"checkpoint file '{file}' is missing")
        if _sha256(file) != manifest["files"][name]:
            raise CheckpointError(f"checkpoint file '{file}' is corrupted: its SHA-256 does not match the "
                                  f"manifest (truncated or modified after saving)")
    return manifest


def full_parameters(directory: Path, manifest: dict, kind: str = "master"):
    """Yield (name, fp32 tensor) for every saved parameter, reading one parameter at a time from the shards
    (peak memory: about the largest parameter, not the model)."""
    handles = {}
    try:
        for g, group in enumerate(manifest["groups"]):
            for p in GroupLayout.from_json(group).params:
                out = torch.empty(p.numel, dtype=torch.float32)
                for c in p.pieces:
                    if c.rank not in handles:
                        handles[c.rank] = safe_open(str(directory / _rank_file(c.rank)), framework="pt")
                    piece = handles[c.rank].get_slice(f"group{g}.{kind}")
                    out[c.param_offset:c.param_offset + c.length] = piece[c.part_offset:c.part_offset + c.length]
                yield p.name, out.view(p.shape)
    finally:
        handles.clear()


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
    _agree_on_failure(engine, error)
    manifest, new_states, client_state, rng, module_state = staged
    # Everything is read and checked on every rank: only now change the engine.
    opt = engine.optimizer_state
    for g, state in enumerate(new_states):
        opt.load_state_chunks(g, state["step"], [(0, {kind: state[kind] for kind in KINDS})])
    live = _module_state(engine.module)
    with torch.no_grad():
        for name, value in module_state.items():
            live[name].copy_(value)
    opt.after_load()
    engine.load_state_dict(manifest["engine"])
    if rng is not None:
        _restore_rng(*rng)
    return client_state


def _agree_on_failure(engine: CheckpointTarget, error: CheckpointError | None) -> None:
    """Raise on every rank if reading failed on any, so no rank goes on into a collective alone."""
    if engine.world_size > 1:
        flag = torch.tensor([0.0 if error is None else 1.0], device=engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if error is None and flag.item() > 0:
            raise CheckpointError("loading the checkpoint failed on another rank (see its error); nothing "
                                  "was changed")
    if error is not None:
        raise error


def _read_for_load(engine: CheckpointTarget, load_dir, tag):
    """Read and verify everything this rank needs; returns (manifest, partitions, client_state, rng)."""
    directory = resolve_tag(load_dir, tag)
    manifest = read_manifest(directory)
    _check_same_model(engine, manifest, directory / MANIFEST)
    same_world = manifest["world_size"] == engine.world_size
    own = [_rank_file(engine.rank)] if same_world else []
    opt = engine.optimizer_state
    if manifest["partitions"] == opt.partitions_count and \
            manifest["groups"] == [g.to_json() for g in opt.layout()]:
        # Same layout: this rank's partition is stored whole in one file; read (and verify) only that.
        shard = _rank_file(engine.rank if opt.partitions_count > 1 else 0)
        read_manifest(directory, sorted({shard, *own, CLIENT_STATE}))
        new_states = _read_own_partition(directory / shard, len(manifest["groups"]))
    else:
        shards = [_rank_file(r) for r in range(manifest["partitions"])]
        read_manifest(directory, sorted(set(shards + own + [CLIENT_STATE])))
        new_states = _reshard(engine, directory, manifest)
    client_state = torch.load(directory / CLIENT_STATE, weights_only=False)
    rng = _read_rng(directory / _rank_file(engine.rank)) if same_world else None
    return manifest, new_states, client_state, rng, _read_module_state(engine, directory, manifest)


def _read_module_state(engine: CheckpointTarget, directory: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The saved buffers and frozen parameters, checked against the model's."""
    if MODULE_STATE not in manifest["files"]:
        return {}
    read_manifest(directory, [MODULE_STATE])
    from safetensors.torch import load_file
    saved = load_file(str(directory / MODULE_STATE))
    live = _module_state(engine.module)
    for name, value in saved.items():
        if name not in live or tuple(live[name].shape) != tuple(value.shape):
            raise CheckpointError(f"checkpoint file '{directory / MODULE_STATE}' holds buffer or frozen "
                                  f"parameter '{name}' {tuple(value.shape)} that this model "
                                  f"{'lacks' if name not in live else f'has as {tuple(live[name].shape)}'}")
    return saved


def _read_own_partition(path: Path, groups: int) -> list[dict]:
    """Each group's saved partition, read whole from one rank file (checkpoint of the same layout)."""
    with safe_open(str(path), framework="pt") as f:
        steps = json.loads(f.metadata()["steps"])
        return [{**{kind: f.get_tensor(f"group{g}.{kind}") for kind in KINDS}, "step": steps[g]}
                for g in range(groups)]


def _reshard(engine: CheckpointTarget, directory: Path, manifest: dict) -> list[dict]:
    """This rank's new partition of each group, built parameter by parameter from the saved layout."""
    zero = engine.optimizer_state
    steps = set()
    for r in range(manifest["partitions"]):
        with safe_open(str(directory / _rank_file(r)), framework="pt") as f:
            steps.update(json.loads(f.metadata()["steps"]))
    if len(steps) > 1:
        raise CheckpointError(f"checkpoint '{directory}' holds different optimizer step counts {sorted(steps)}")
    step = steps.pop() if steps else 0
    rank = engine.rank if zero.partitions_count > 1 else 0
    layout = zero.layout()
    where = {p.name: (g, p) for g, group in enumerate(layout) for p in group.params}
    new = {kind: [torch.zeros(group.partition_numel, dtype=torch.float32) for group in layout] for kind in KINDS}
    for kind in KINDS:
        for name, tensor in full_parameters(directory, manifest, kind):
            g, placement = where[name]
            flat = tensor.reshape(-1)
            for c in placement.pieces:
                if c.rank == rank:
                    new[kind][g][c.part_offset:c.part_offset + c.length] = \
                        flat[c.param_offset:c.param_offset + c.length]
    return [{**{kind: new[kind][g] for kind in KINDS}, "step": step} for g in range(len(layout))]


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
