"""Resume from a checkpoint that PyTorch FSDP2 (or torchtitan) wrote with ``torch.distributed.checkpoint``,
and write one that FSDP2 resumes (`save_dcp`): a DCP directory (``.metadata`` beside ``*.distcp``
files) of the model and optimizer state dicts as
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` returns them (fully qualified parameter
names; AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter) and ``dcp.save`` writes, under the keys the
script chose: torchtitan's (the model at the top level, the optimizer under ``"optimizer"``), ``{"model", "optim"}``,
``{"model", "optimizer"}`` or the tutorial's ``{"app": {"model", "optim"}}``; a reader finds them by the parameters'
names (`zero_offload.checkpoint.dcp_layout`).

`load_dcp` loads the fp32 parameters as master weights, the Adam moments and the step count into this engine, at any
ZeRO stage and world size: DCP reshards on read, and each rank reads, one parameter at a time, only the parameters
its partition holds pieces of (never more than one parameter's full state beyond the engine's own memory).
Buffers and frozen parameters present in the checkpoint are loaded too. The learning rate and its schedule are the
engine's config's (an FSDP2 checkpoint's schedule belongs to the script that wrote it): the step count moves to the
checkpoint's, and the schedule with it (ours are functions of the step), so a run resumed mid-warm-up goes on
warming up from there. Everything is checked before the engine changes: a checkpoint of another model names the first
parameter that is missing or shaped otherwise, and an unreadable or truncated file names the file.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
import torch

from zero_offload.checkpoint.dcp_layout import TORCHTITAN, DcpLayout, find_layout
from zero_offload.checkpoint.foreign import ForeignState, apply_foreign, export_staged
from zero_offload.checkpoint.io import CheckpointError, agree, module_state, staged_directory
from zero_offload.checkpoint.safe_pickle import UntrustedPickleError, dcp_reader
from zero_offload.runtime.state import CheckpointTarget

__all__ = ["is_dcp", "load_dcp", "save_dcp", "read_dcp", "read_metadata", "adamw_group"]

_METADATA = ".metadata"


def is_dcp(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``torch.distributed.checkpoint`` directory (it holds ``.metadata``)."""
    return (Path(path) / _METADATA).is_file()


def read_metadata(path: Path) -> dict:
    """{flattened key: storage metadata} of the checkpoint, after checking that every data file holds the bytes
    the metadata places in it (a truncated file is named here, before anything is read; DCP keeps no checksums,
    so bytes changed in place go unnoticed)."""
    try:
        metadata = dcp_reader(path).read_metadata()
    except UntrustedPickleError:
        raise
    except Exception as e:                       # unpickling a damaged file raises anything
        raise CheckpointError(f"checkpoint file '{path / _METADATA}' cannot be read as DCP metadata: {e}") from e
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file() or file.stat().st_size < end:
            raise CheckpointError(f"checkpoint file '{file}' is missing or truncated: the metadata places {end} "
                                  f"bytes in it")
    return metadata.state_dict_metadata


def _check(engine: CheckpointTarget, meta: dict, path: Path, keys: tuple[str, str] | None) -> DcpLayout:
    """Every trainable parameter of this engine, with its shape, and its Adam state must be in the checkpoint, under
    ``keys`` (the model's and the optimizer's key paths) or where `find_layout` finds them; returns the layout."""
    if engine.optimizer_state.state_format() != "adam":
        raise CheckpointError(f"checkpoint '{path}': an FSDP2 checkpoint carries AdamW's states; this engine's "
                              f"optimizer keeps {engine.optimizer_state.state_format()!r}")
    params = [p for group in engine.optimizer_state.layout() for p in group.params]
    layout = DcpLayout(*keys) if keys is not None else find_layout(meta, [p.name for p in params], path)
    for p in params:
        saved = meta.get(layout.model_key(p.name))
        if saved is None or not hasattr(saved, "size"):
            raise CheckpointError(f"checkpoint '{path}' is from another model: it has no parameter '{p.name}' "
                                  f"(under '{layout.model}')")
        if tuple(saved.size) != tuple(p.shape):
            raise CheckpointError(f"checkpoint '{path}' is from another model: parameter '{p.name}' has shape "
                                  f"{list(saved.size)} there and {list(p.shape)} here")
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            if layout.optim_key("state", p.name, kind) not in meta:
                raise CheckpointError(f"checkpoint '{path}' has no optimizer state '{kind}' for parameter "
                                      f"'{p.name}' (under '{layout.optim_key('state')}'): not an AdamW checkpoint")
    return layout


def read_dcp(path: Path, template: dict) -> dict:
    """``template`` filled from the DCP directory ``path`` (one process, resharding on read).

    Raises:
        CheckpointError: a damaged or truncated file, naming the directory.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        with warnings.catch_warnings():          # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(template, storage_reader=dcp_reader(path), no_dist=True)
    except (Exception, CheckpointException) as e:    # a damaged *.distcp file (CheckpointException: BaseException)
        raise CheckpointError(f"checkpoint '{path}' could not be read ({type(e).__name__}: {e}); a .distcp file "
                              f"is truncated or damaged") from e
    return template


def _step(engine: CheckpointTarget, path: Path, layout: DcpLayout) -> int:
    names = [p.name for g in engine.optimizer_state.layout() for p in g.params]
    template = layout.nest(optim={"state": {n: {"step": torch.zeros(())} for n in names}})
    steps = {int(v["step"].item()) for v in layout.optim_part(read_dcp(path, template))["state"].values()}
    if len(steps) != 1:
        raise CheckpointError(f"checkpoint '{path}' holds different step counts {sorted(steps)} for its parameters")
    return steps.pop()


def _reader(path: Path, layout: DcpLayout):
    """`ParamReader` of the DCP directory: one parameter's weights and moments per call."""
    def read(name: str, shape: tuple) -> dict:
        state = {"exp_avg": torch.empty(shape), "exp_avg_sq": torch.empty(shape)}
        got = read_dcp(path, layout.nest({name: torch.empty(shape)}, {"state": {name: state}}))
        return {"master": layout.model_part(got)[name].reshape(-1),
                **{k: v.reshape(-1) for k, v in layout.optim_part(got)["state"][name].items()}}
    return read


def load_dcp(engine: CheckpointTarget, path: str | os.PathLike, keys: tuple[str, str] | None = None) -> None:
    """Load an FSDP2 DCP checkpoint into ``engine`` (see the module docstring). A collective: every rank calls it.

    Args:
        path: the DCP directory (the one holding ``.metadata``).
        keys: the model's and the optimizer's key paths in it (dotted, ``""`` the top level); None: found by the
            parameters' names (`zero_offload.checkpoint.dcp_layout.find_layout`).

    Raises:
        CheckpointError: an unreadable or damaged file (named), a checkpoint of another model (the first parameter
            that differs named), no AdamW state, or the model or optimizer under several prefixes (named); nothing
            in the engine is changed then.
    """
    path = Path(path)
    error, step, extra, layout = None, 0, {}, TORCHTITAN
    try:
        meta = read_metadata(path)
        layout = _check(engine, meta, path, keys)
        step = _step(engine, path, layout)
        live = module_state(engine.module)
        wanted = {n: torch.empty_like(t, device="cpu") for n, t in live.items() if layout.model_key(n) in meta}
        extra = layout.model_part(read_dcp(path, layout.nest(wanted))) if wanted else {}
    except CheckpointError as e:
        error = e
    agree(engine, error, "loading the DCP checkpoint")
    apply_foreign(engine, _reader(path, layout), ForeignState(
        step=step, engine={"global_step": step, **_schedule_at(engine, step)}, module=extra))


def _schedule_at(engine: CheckpointTarget, step: int) -> dict:
    """The engine's LR schedule moved to ``step``: a DCP checkpoint carries no schedule, and ours are functions
    of the step (DeepSpeed's ``last_batch_iteration``, one behind the step count)."""
    schedule = engine.state_dict()["lr_scheduler"]
    return {} if schedule is None else {"lr_scheduler": {**schedule, "last_batch_iteration": step - 1}}


def save_dcp(engine: CheckpointTarget, path: str | os.PathLike, keys: tuple[str, str] = ("", "optimizer")) -> Path:
    """Write ``path`` as a DCP directory that FSDP2 resumes: ``dcp.load`` into the templates of
    ``get_state_dict(model, optimizer)`` placed under ``keys``, then ``set_state_dict``. A collective: every rank
    calls it.

    ``keys``: the model's and the optimizer's key paths (dotted; ``""`` the top level); default torchtitan's, the
    model at the top level and the optimizer under ``"optimizer"`` (`zero_offload.checkpoint.dcp_layout`). Under the
    model's: ``{name: fp32 tensor}`` (masters, buffers, frozen parameters; a tied alias under each of its names);
    under the optimizer's: ``{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [one per param
    group: AdamW's keys with this engine's learning rate, betas, eps and weight decay, and the parameters'
    names]}``. The
    engine's own sharded checkpoint is written first into ``path``'s parent (`save_checkpoint`, every rank); rank 0
    writes the DCP from it, one tensor per ``.distcp`` file, each read from the shards only when DCP writes it
    (`dcp_stream.StreamingPlanner`), so rank 0 holds about one parameter; the staging checkpoint is then removed.
    The DCP is written into a directory beside ``path`` and renamed to it when complete: a failed write leaves an
    existing ``path`` as it was.

    Raises:
        CheckpointError: writing failed on some rank (named); the engine is not changed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from zero_offload.checkpoint.dcp_stream import ModuleFile, StreamingPlanner
    from zero_offload.checkpoint.load import SavedParameters
    path, layout = Path(path), DcpLayout(*keys)
    opt = engine.optimizer_state
    names = [[p.name for p in g.params] for g in opt.layout()]
    steps = [opt.group_step(g) for g in range(len(names))]
    groups = [adamw_group(h, group) for h, group in zip(engine.optimizer.param_groups, names)]

    def write(directory: Path, manifest: dict) -> None:
        with SavedParameters(directory, manifest) as saved, ModuleFile(directory, manifest) as module:
            fetch, model = {}, {}
            aliases = manifest.get("aliases", {})
            for name in manifest["state_dict_keys"]:
                first = aliases.get(name, name)
                if first in saved.names:
                    model[name] = torch.empty(saved.shape(first), device="meta")
                    fetch[layout.model_key(name)] = lambda n=first: saved.read(n, "master")
                elif first in module.names:
                    model[name] = module.meta(first)
                    fetch[layout.model_key(name)] = lambda n=first: module.read(n)
            state = {}
            for g, group in enumerate(names):
                for n in group:
                    state[n] = {"step": torch.tensor(float(steps[g]))}
                    for kind in ("exp_avg", "exp_avg_sq"):
                        state[n][kind] = torch.empty(saved.shape(n), device="meta")
                        fetch[layout.optim_key("state", n, kind)] = lambda n=n, kind=kind: saved.read(n, kind)
            with warnings.catch_warnings(), staged_directory(path, "dcp") as staging:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                try:
                    dcp.save(layout.nest(model, {"state": state, "param_groups": groups}),
                             storage_writer=FileSystemWriter(str(staging), single_file_per_rank=False),
                             planner=StreamingPlanner(fetch), no_dist=True)
                except CheckpointException as e:        # DCP's (a BaseException): the first failure, as ours
                    cause = next(iter(e.failures.values()))[0]
                    raise CheckpointError(f"{type(cause).__name__}: {cause}") from cause

    export_staged(engine, path, write, "the DCP checkpoint")
    return path


def adamw_group(hparams: dict, names: list) -> dict:
    """One param group as ``torch.optim.AdamW`` keeps it, with this engine's hyperparameters, and its base lr as
    ``initial_lr``, the key every torch LR scheduler adds to its optimizer's groups (so that a script with one loads
    it with ``dcp.load`` and ``set_state_dict``)."""
    return {"lr": float(hparams["lr"]), "initial_lr": float(hparams.get("initial_lr", hparams["lr"])), "betas": tuple(hparams.get("betas", (0.9, 0.999))),
            "eps": float(hparams.get("eps", 1e-8)), "weight_decay": float(hparams.get("weight_decay", 0.0)),
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": bool(hparams.get("adamw_mode", True)), "params": list(names)}
