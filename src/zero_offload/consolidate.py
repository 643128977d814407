"""Export a sharded checkpoint as one state dict or one safetensors file, one parameter at a time.

`consolidate` returns {name: fp32 tensor} under the model's own parameter names (DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint``); `export_safetensors` streams the same tensors into a
``.safetensors`` file without holding the model in memory: the header is written from the manifest's
shapes first, then each parameter's bytes as it is assembled from the shards, so peak memory is about the
largest parameter.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from zero_offload.checkpoint import CheckpointError, full_parameters, read_manifest, resolve_tag

__all__ = ["consolidate", "export_safetensors"]

_DTYPES = {"fp32": (torch.float32, "F32", 4), "bf16": (torch.bfloat16, "BF16", 2)}


def _open(checkpoint_dir, tag) -> tuple[Path, dict]:
    directory = resolve_tag(checkpoint_dir, tag)
    manifest = read_manifest(directory)
    shards = [f"rank{r:05d}.safetensors" for r in range(manifest["partitions"])]
    read_manifest(directory, shards)      # checksums before anything is read
    return directory, manifest


def consolidate(checkpoint_dir: str | os.PathLike, tag: str | None = None) -> dict[str, torch.Tensor]:
    """{parameter name: fp32 CPU tensor} from the fp32 master weights of checkpoint ``tag`` (default: latest).

    Raises:
        CheckpointError: a missing directory, tag or shard, or a shard whose checksum does not match.
    """
    directory, manifest = _open(checkpoint_dir, tag)
    return {name: t.clone() for name, t in full_parameters(directory, manifest)}


def export_safetensors(checkpoint_dir: str | os.PathLike, out: str | os.PathLike, tag: str | None = None,
                       dtype: str = "fp32") -> Path:
    """Write the checkpoint's parameters to one safetensors file, streamed parameter by parameter.

    The file loads with ``safetensors.torch.load_file``; tensors are ``dtype`` (fp32 or bf16). It is
    written under a temporary name and renamed when complete.

    Raises:
        CheckpointError: as `consolidate`, or an unknown ``dtype``.
    """
    if dtype not in _DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    torch_dtype, st_dtype, size = _DTYPES[dtype]
    directory, manifest = _open(checkpoint_dir, tag)
    params = [p for g in manifest["groups"] for p in g["params"]]
    header, offset = {}, 0
    for p in params:
        header[p["name"]] = {"dtype": st_dtype, "shape": p["shape"], "data_offsets": [offset, offset + p["numel"] * size]}
        offset += p["numel"] * size
    header["__metadata__"] = {"format": "pt", "source": str(directory), "step": str(manifest["engine"]["global_step"])}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)       # the data section starts 8-byte aligned
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, tensor in full_parameters(directory, manifest):
            f.write(memoryview(tensor.to(torch_dtype).contiguous().view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out
