"""Which reader or writer a checkpoint goes through: our own format, DeepSpeed's (ZeRO or universal) and FSDP2's
DCP, chosen by what is on disk when loading and by ``format`` when saving. The engine and `convert` both call these,
so a checkpoint loads and saves the same way through either.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from zero_offload.checkpoint.dcp import is_dcp, load_dcp, save_dcp
from zero_offload.checkpoint.deepspeed_read import find_deepspeed, load_deepspeed
from zero_offload.checkpoint.deepspeed_write import save_universal
from zero_offload.checkpoint.load import load_checkpoint
from zero_offload.checkpoint.safe_pickle import trusting_pickles
from zero_offload.checkpoint.save import save_checkpoint
from zero_offload.runtime.state import CheckpointTarget

__all__ = ["SAVE_FORMATS", "TORCHTITAN_KEYS", "load_any", "save_any"]

SAVE_FORMATS = ("zero-offload", "deepspeed-universal", "dcp")
TORCHTITAN_KEYS = ("", "optimizer")     # DCP: the model at the top level, the optimizer under "optimizer"


def load_any(target: CheckpointTarget, load_dir: str | os.PathLike, tag: str | None = None, *,
             load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
             load_module_only: bool = False, trust_pickles: bool = False) -> Any:
    """Load the checkpoint at ``load_dir`` (``tag``, default the latest) into ``target``: a DCP directory
    (``load_dir`` or ``load_dir/tag`` holds ``.metadata``; returns None), a DeepSpeed checkpoint (the flags are
    DeepSpeed's ``load_checkpoint``'s; returns its ``client_state`` keys), else our own (returns its
    ``client_state``). A collective. Pickled files (the client state, DeepSpeed's ``.pt`` files, DCP's metadata)
    load through an allow-list of data types unless ``trust_pickles`` (`zero_offload.checkpoint.safe_pickle`).

    Raises:
        UntrustedPickleError: a pickle names a type outside the allow-list (the file and the type named).
        CheckpointError: as `load_dcp`, `load_deepspeed` and `load_checkpoint` say; ``target`` is unchanged then.
    """
    with trusting_pickles(trust_pickles):
        dcp_dir = Path(load_dir) / tag if tag is not None else Path(load_dir)
        if is_dcp(dcp_dir):
            return load_dcp(target, dcp_dir)
        deepspeed_dir = find_deepspeed(load_dir, tag)
        if deepspeed_dir is not None:
            return load_deepspeed(target, deepspeed_dir, load_optimizer_states, load_lr_scheduler_states,
                                  load_module_only)
        return load_checkpoint(target, load_dir, tag)


def save_any(target: CheckpointTarget, save_dir: str | os.PathLike, tag: str | None = None,
             client_state: Any = None, format: str = "zero-offload",
             dcp_keys: tuple[str, str] = TORCHTITAN_KEYS) -> Path:
    """Save ``target`` as ``format`` (one of `SAVE_FORMATS`): our own under ``save_dir/tag``, DeepSpeed's universal
    layout under ``save_dir/tag``, or a DCP directory at ``save_dir`` (``save_dir/tag`` when a tag is given) with
    the model and optimizer under ``dcp_keys`` (dotted key paths; default torchtitan's, `save_dcp`). Returns the
    directory written. A collective.

    Raises:
        ValueError: an unknown ``format``, ``client_state`` with ``format="dcp"`` (DCP has no place for it), or
            one that is not a dict with ``format="deepspeed-universal"`` (DeepSpeed keeps its keys).
        CheckpointError: writing failed (`save_checkpoint`, `save_dcp`, `save_universal` name the file).
    """
    if format not in SAVE_FORMATS:
        raise ValueError(f"save_checkpoint: format must be 'zero-offload', 'deepspeed-universal' or 'dcp', got "
                         f"{format!r}")
    if format == "dcp":
        if client_state is not None:
            raise ValueError("save_checkpoint: format='dcp' has no place for client_state; save it yourself")
        return save_dcp(target, Path(save_dir) / tag if tag is not None else Path(save_dir), dcp_keys)
    if format == "deepspeed-universal":
        return save_universal(target, save_dir, tag, client_state)
    return save_checkpoint(target, save_dir, tag, client_state)
