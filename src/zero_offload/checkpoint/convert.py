"""``zero-offload convert SRC DST --to FORMAT``: a checkpoint of any kind this engine reads (its own, DeepSpeed's
ZeRO or universal, FSDP2's DCP) rewritten as its own, DeepSpeed's universal layout or DCP, offline, on one
process, without a GPU and without the model's code.

The conversion is a load and a save through `ConversionTarget`: a skeleton model whose parameters and buffers
carry the checkpoint's names and shapes (its parameters on the meta device), under the checkpoint's own config (ours
keeps it in the manifest, DeepSpeed in ``ds_config``; a DCP checkpoint has none, so ``--config`` names one). The
readers and writers are the ones `engine.load_checkpoint` and `engine.save_checkpoint` use, and what they guarantee
holds here: everything is checked before anything is taken, the save is atomic. Nothing is held whole: the target's
partitions are the source's stream of pieces, read one parameter (or one slice) at a time as the writer asks for
them (`convert_target.StreamedPartitions`), so peak memory is about one parameter's fp32 state.
"""
from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zero_offload.checkpoint.convert_target import ConversionTarget
from zero_offload.checkpoint.formats import SAVE_FORMATS as FORMATS
from zero_offload.checkpoint.formats import TORCHTITAN_KEYS, load_any, save_any
from zero_offload.checkpoint.io import CheckpointError
from zero_offload.checkpoint.safe_pickle import trusting_pickles
from zero_offload.checkpoint.save import HYPERPARAMETERS

__all__ = ["convert", "FORMATS"]


@dataclass
class _Source:
    """What the conversion engine is built from: the param groups (hyperparameters and parameter names), every
    trainable parameter's shape, the buffers and frozen parameters, and the checkpoint's config ({} for none)."""
    groups: list[tuple[dict, list[str]]]
    shapes: dict[str, tuple]
    extras: dict[str, torch.Tensor]
    config: dict
    aliases: dict[str, str] = field(default_factory=dict)     # tied name -> the trainable name it shares


def _source(src: Path, tag: str | None) -> _Source:
    from zero_offload.checkpoint.dcp import is_dcp
    from zero_offload.checkpoint.deepspeed_read import find_deepspeed, read_deepspeed
    if is_dcp(src / tag if tag else src):
        return _dcp_source(src / tag if tag else src)
    deepspeed = find_deepspeed(src, tag)
    if deepspeed is not None:
        reader = read_deepspeed(deepspeed)
        return _Source(reader.named_groups(), dict(reader.shapes), reader.module_state(),
                       dict(reader.model.get("ds_config") or {}))
    from zero_offload.checkpoint.io import MODULE_STATE
    from zero_offload.checkpoint.load import read_manifest, resolve_tag
    directory = resolve_tag(src, tag)
    manifest = read_manifest(directory)
    names = [[p["name"] for p in g["params"]] for g in manifest["groups"]]
    config = dict(manifest.get("config") or {})
    saved = manifest.get("param_groups") or [{"lr": lr, **(config.get("optimizer") or {}).get("params", {})}
                                             for lr in manifest["engine"]["lrs"]]
    extras = {}
    if MODULE_STATE in manifest["files"]:
        from safetensors.torch import load_file
        read_manifest(directory, [MODULE_STATE])
        extras = load_file(str(directory / MODULE_STATE))
    return _Source(list(zip(saved, names)), {p["name"]: tuple(p["shape"]) for g in manifest["groups"]
                                              for p in g["params"]}, extras, config)


def _dcp_source(path: Path) -> _Source:
    from zero_offload.checkpoint.dcp import read_dcp, read_metadata
    from zero_offload.checkpoint.dcp_layout import DcpLayout, model_root, optimizer_names
    meta = read_metadata(path)
    optim, names = optimizer_names(meta, path)
    layout = DcpLayout(model_root(meta, sorted(names), path), optim)
    prefix = layout.optim_key("param_groups") + "."
    keys = sorted({k[len(prefix):].split(".", 1)[1] for k in meta if k.startswith(prefix)})
    count = len({k[len(prefix):].split(".", 1)[0] for k in meta if k.startswith(prefix)})
    template = layout.nest(optim={"param_groups": [{k: None for k in keys} for _ in range(count)]})
    param_groups = layout.optim_part(read_dcp(path, template))["param_groups"]
    # The model's tensors: those under its root, outside the optimizer's (torchtitan keeps the model at the top).
    inside = (lambda k: True) if not layout.model else (lambda k: k.startswith(layout.model + "."))  # noqa: E731
    optimizer = tuple(layout.optim_key(part) + "." for part in ("state", "param_groups"))
    model = {k[len(layout.model_key("")):]: tuple(v.size) for k, v in meta.items()
             if inside(k) and not k.startswith(optimizer) and hasattr(v, "size")}
    trainable = {n: s for n, s in model.items() if n in names}
    groups = [({k: v for k, v in g.items() if k != "params"}, [n for n in g["params"] if n in trainable])
              for g in param_groups]
    extras, aliases = {}, {}
    for name in (n for n in model if n not in trainable):
        value = _dcp_tensor(path, layout, name, model[name])
        # A tied name (GPT-2's lm_head.weight) has no optimizer state of its own: the same values as a parameter.
        twin = next((t for t, shape in trainable.items() if shape == model[name] and
                     torch.equal(_dcp_tensor(path, layout, t, shape), value)), None)
        if twin is None:
            extras[name] = value
        else:
            aliases[name] = twin
    return _Source(groups, trainable, extras, {}, aliases)


def _dcp_tensor(path: Path, layout, name: str, shape: tuple) -> torch.Tensor:
    from zero_offload.checkpoint.dcp import read_dcp
    return layout.model_part(read_dcp(path, layout.nest({name: torch.empty(shape)})))[name]


def skeleton(shapes: dict[str, tuple], extras: dict[str, torch.Tensor],
             aliases: dict[str, str] | None = None, device: str = "cpu") -> torch.nn.Module:
    """A module with a parameter of each trainable name and shape (values unset; on ``device``, "meta" for none
    allocated), each alias the same parameter as its target (tied weights), and a buffer of each other state name
    (buffers and frozen parameters alike), nested as the dotted names say."""
    root = torch.nn.Module()

    def owner(name: str) -> tuple[torch.nn.Module, str]:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        return module, leaf

    for name, shape in shapes.items():
        module, leaf = owner(name)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, device=device)))
    for name, target in (aliases or {}).items():
        module, leaf = owner(name)
        target_module, target_leaf = owner(target)
        module.register_parameter(leaf, getattr(target_module, target_leaf))
    for name, value in extras.items():
        module, leaf = owner(name)
        module.register_buffer(leaf, value.clone())
    return root


def _config(saved: dict, given: str | None) -> dict:
    """The conversion's config: the checkpoint's (or ``given``'s) optimizer, schedule, precision and loss scaling,
    on one process with the optimizer offloaded."""
    if given is not None:
        from zero_offload.config.io import read_config_file
        saved = read_config_file(given)
    if "optimizer" not in saved:
        raise CheckpointError("convert: the checkpoint carries no config (a DCP checkpoint); name the training "
                              "config with --config")
    config = {k: copy.deepcopy(saved[k]) for k in ("optimizer", "scheduler", "fp16", "bf16", "gradient_clipping")
              if saved.get(k) is not None}
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                  zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    return config


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str, tag: str | None = None,
            config: str | None = None, dcp_keys: tuple[str, str] = TORCHTITAN_KEYS, trust_pickles: bool = False
            ) -> Path:
    """Rewrite the checkpoint at ``src`` (its ``tag``, default the latest) as ``to`` (one of `FORMATS`) at ``dst``;
    returns what `engine.save_checkpoint` returns (the tag directory, or the DCP directory). A DCP source's layout
    is found by the names (`zero_offload.checkpoint.dcp_layout`); a DCP written has the model and the optimizer
    under ``dcp_keys`` (default torchtitan's). Pickled files load through the allow-list of data types unless
    ``trust_pickles`` (`zero_offload.checkpoint.safe_pickle`).

    Raises:
        CheckpointError: ``src`` unreadable, damaged or unmappable (named, as `engine.load_checkpoint` says), or
            a DCP source without ``config``; nothing is written at ``dst`` then.
        ConfigError: an invalid config (the checkpoint's or ``config``'s).
        ValueError: an unknown ``to``.
    """
    with trusting_pickles(trust_pickles):
        return _convert(Path(src), dst, to, tag, config, dcp_keys, trust_pickles)


def _convert(src: Path, dst, to: str, tag: str | None, config: str | None, dcp_keys: tuple[str, str],
             trust_pickles: bool) -> Path:
    if to not in FORMATS:
        raise ValueError(f"convert: --to must be one of {', '.join(FORMATS)}, got {to!r}")
    if not src.exists():
        raise CheckpointError(f"convert: checkpoint directory '{src}' does not exist")
    source = _source(src, tag)
    model = skeleton(source.shapes, source.extras, source.aliases, "meta")
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    groups = [({k: h[k] for k in HYPERPARAMETERS if k in h}, sorted(names, key=order.__getitem__))
              for h, names in source.groups if names]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # the source config's keys that do not apply here
        target = ConversionTarget(model, _config(source.config, config), groups)
    client_state = load_any(target, src, tag, trust_pickles=trust_pickles)
    return save_any(target, dst, None, client_state if client_state and to != "dcp" else None, to, dcp_keys)


def describe(path: Path) -> str:
    """One line on what was written at ``path``."""
    files = [p for p in path.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    return f"wrote {path} ({len(files)} files, {size / 2**20:.1f} MiB)"

