"""Export a sharded checkpoint as one state dict or one safetensors file, one parameter at a time.

`consolidate` returns every name of the model's ``state_dict()`` (DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint``): trainable parameters from the fp32 master weights, frozen
parameters and persistent buffers from the module state (floating ones as fp32), and each tied alias (GPT-2's
``lm_head.weight``) as the same tensor as its first name, so ``model.load_state_dict(sd, strict=True)``
loads it. `export_safetensors` streams the same tensors into a ``.safetensors`` file without holding the
model in memory: the header is written from the manifest's shapes first, then each tensor's bytes as it is
assembled from the shards, so peak memory is about the largest parameter.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import struct
from pathlib import Path

import torch

from safetensors import safe_open

from zero_offload.checkpoint.io import MODULE_STATE, CheckpointError
from zero_offload.checkpoint.load import full_parameters, read_manifest, resolve_tag

__all__ = ["consolidate", "export_safetensors"]

_DTYPES = {"fp32": (torch.float32, "F32", 4), "bf16": (torch.bfloat16, "BF16", 2)}


def _open(checkpoint_dir, tag) -> tuple[Path, dict]:
    directory = resolve_tag(checkpoint_dir, tag)
    manifest = read_manifest(directory)
    shards = [f"rank{r:05d}.safetensors" for r in range(manifest["partitions"])]
    read_manifest(directory, shards)      # checksums before anything is read
    return directory, manifest


def _module_state(directory: Path, manifest: dict):
    """Yield (name, tensor) of the saved frozen parameters and persistent buffers, one at a time."""
    if MODULE_STATE not in manifest["files"]:
        return
    read_manifest(directory, [MODULE_STATE])
    with safe_open(str(directory / MODULE_STATE), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            yield name, t.float() if t.is_floating_point() else t


def _all_tensors(directory: Path, manifest: dict):
    """Yield (name, tensor) for every state_dict name, tied aliases after their first name."""
    aliases: dict[str, list[str]] = {}
    for alias, target in manifest.get("aliases", {}).items():
        aliases.setdefault(target, []).append(alias)
    for name, t in itertools.chain(full_parameters(directory, manifest), _module_state(directory, manifest)):
        yield name, t
        for alias in aliases.get(name, []):
            yield alias, t


def consolidate(checkpoint_dir: str | os.PathLike, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Every ``state_dict()`` name of the saved model -> CPU tensor (fp32 for floating point), from
    checkpoint ``tag`` (default: latest), in the model's ``state_dict()`` order; tied aliases share a tensor.

    Raises:
        CheckpointError: a missing directory, tag or shard, or a shard whose checksum does not match.
    """
    directory, manifest = _open(checkpoint_dir, tag)
    out: dict[str, torch.Tensor] = {}
    aliases = set(manifest.get("aliases", {}))
    last = last_clone = None      # an alias comes right after its first name, as the same tensor object
    for name, t in _all_tensors(directory, manifest):
        if name in out and name in aliases:
            continue              # a frozen alias, also in the module state under its own name: keep it shared
        if t is not last:         # (not id(): a freed tensor's id is reused by the next one)
            last, last_clone = t, t.clone()
        out[name] = last_clone
    order = manifest.get("state_dict_keys")
    return {k: out[k] for k in order if k in out} | out if order else out


def _header_entries(directory: Path, manifest: dict, torch_dtype, st_dtype: str, size: int):
    """(name, safetensors dtype, shape, nbytes) for every tensor `_all_tensors` yields, without reading data."""
    entries = [(p["name"], st_dtype, p["shape"], p["numel"] * size)
               for g in manifest["groups"] for p in g["params"]]
    if MODULE_STATE in manifest["files"]:
        with safe_open(str(directory / MODULE_STATE), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape, dt = sl.get_shape(), sl.get_dtype()
                numel = math.prod(shape)
                floating = dt in ("F16", "BF16", "F32", "F64")
                entries.append((name, st_dtype if floating else dt, shape,
                                numel * (size if floating else _ST_SIZES[dt])))
    by_name = {e[0]: e for e in entries}
    aliases: dict[str, list[str]] = {}
    for alias, target in manifest.get("aliases", {}).items():
        aliases.setdefault(target, []).append(alias)
    out = []
    for e in entries:
        out.append(e)
        out += [(a, *by_name[e[0]][1:]) for a in aliases.get(e[0], [])]
    return out


_ST_SIZES = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F64": 8}


def export_safetensors(checkpoint_dir: str | os.PathLike, out: str | os.PathLike, tag: str | None = None,
                       dtype: str = "fp32") -> Path:
    """Write every state_dict name of the checkpoint to one safetensors file, streamed tensor by tensor.

    The file loads with ``safetensors.torch.load_file``; floating tensors are ``dtype`` (fp32 or bf16),
    integer buffers keep their dtype, tied aliases are written under each name. It is written under a
    temporary name and renamed when complete.

    Raises:
        CheckpointError: as `consolidate`, or an unknown ``dtype``.
    """
    if dtype not in _DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    torch_dtype, st_dtype, size = _DTYPES[dtype]
    directory, manifest = _open(checkpoint_dir, tag)
    header, offset = {}, 0
    for name, st, shape, nbytes in _header_entries(directory, manifest, torch_dtype, st_dtype, size):
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "source": str(directory), "step": str(manifest["engine"]["global_step"])}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)       # the data section starts 8-byte aligned
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, tensor in _all_tensors(directory, manifest):
            t = tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
            f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out
