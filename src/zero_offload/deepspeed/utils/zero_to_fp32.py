"""``deepspeed.utils.zero_to_fp32``: a ZeRO checkpoint's fp32 weights as one state dict, from zero-offload's own
checkpoints (`zero_offload.consolidate`) and from DeepSpeed's (stages 1-3 and universal:
`zero_offload.checkpoint.deepspeed_read`), under DeepSpeed 0.19.8's function names and arguments.

Files are read through safetensors and the allow-list unpickler, never ``torch.load(weights_only=False)``.
"""
from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import torch

from zero_offload.checkpoint import consolidate
from zero_offload.checkpoint.deepspeed_read import find_deepspeed, read_deepspeed
from zero_offload.checkpoint.safe_pickle import trusting_pickles
from zero_offload.checkpoint.load import resolve_tag

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint", "get_model_state_file", "get_model_state_files",
           "get_optim_files", "get_checkpoint_files"]


def _natural(text: str) -> list:
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir, glob_pattern: str) -> list[str]:
    """The files of ``checkpoint_dir`` matching ``glob_pattern``, in natural order (rank 2 before rank 10).

    Raises:
        FileNotFoundError: none (DeepSpeed's error).
    """
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=_natural)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir) -> list[str]:
    """A DeepSpeed tag directory's ``*_optim_states.pt`` files, by rank."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_model_state_file(checkpoint_dir, zero_stage: int) -> str:
    """The model states file of a DeepSpeed tag directory at ``zero_stage`` (DeepSpeed's names).

    Raises:
        FileNotFoundError: no such directory or file.
    """
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    name = "mp_rank_00_model_states.pt" if zero_stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def _deepspeed_state_dict(directory: Path, exclude_frozen_parameters: bool) -> dict[str, torch.Tensor]:
    reader = read_deepspeed(directory)
    out = {name: reader.read(name, shape)["master"].view(shape) for name, shape in reader.shapes.items()}
    if not exclude_frozen_parameters:
        for name, t in reader.module_state().items():
            out.setdefault(name, t.float() if t.is_floating_point() else t)
    for alias, target in (reader.model.get("shared_params") or {}).items():   # tied names, as DeepSpeed adds them
        if target in out:
            out[alias] = out[target]
    return out


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False, *, trust_pickles: bool = False
                                             ) -> dict[str, torch.Tensor]:
    """{name: fp32 CPU tensor} of the model in ``checkpoint_dir`` (``tag``, default the one ``latest`` names).
    ``lazy_mode`` is accepted; the tensors are read at once. DeepSpeed's pickled files load through the allow-list
    of data types unless ``trust_pickles`` (not DeepSpeed's keyword; DeepSpeed unpickles anything).

    Raises:
        UntrustedPickleError: a file names a type outside the allow-list (the file and the type named).
        CheckpointError: no checkpoint there (neither zero-offload's nor DeepSpeed's), or a damaged one.
    """
    deepspeed = find_deepspeed(checkpoint_dir, tag)
    if deepspeed is not None:
        with trusting_pickles(trust_pickles):
            return _deepspeed_state_dict(deepspeed, exclude_frozen_parameters)
    state = consolidate(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        from safetensors import safe_open
        from zero_offload.checkpoint.io import MODULE_STATE
        frozen = resolve_tag(checkpoint_dir, tag) / MODULE_STATE
        if frozen.is_file():
            with safe_open(str(frozen), framework="pt") as f:
                state = {k: v for k, v in state.items() if k not in set(f.keys())}
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag=None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the fp32 state dict to ``output_dir`` as ``pytorch_model.bin`` (``model.safetensors`` with
    ``safe_serialization``), one file; ``max_shard_size`` is accepted and not used to split."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file
        seen: dict[int, str] = {}
        unique = {}
        for k, v in state.items():     # safetensors refuses shared storage: tied aliases written once
            if id(v) not in seen:
                seen[id(v)] = k
                unique[k] = v.contiguous()
        save_file(unique, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, os.path.join(output_dir, "pytorch_model.bin"))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Load the fp32 weights into ``model`` (moved to the CPU, as DeepSpeed does) and return it.

    Raises:
        CheckpointError: as `get_fp32_state_dict_from_zero_checkpoint`.
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model

