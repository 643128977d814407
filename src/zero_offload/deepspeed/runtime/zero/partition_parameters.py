"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters``, ``ZeroParamStatus`` and the
stage-3 parameter attributes (``ds_id``, ``ds_status``, ``ds_shape``, ``ds_numel``, ``ds_tensor``, ``ds_persist``).

The attributes are read live, never stored on a parameter: importing this face gives ``torch.Tensor`` (so every
parameter, and an alias of one) read-only properties that ask the stage-3 registry
(`zero_offload.zero.stage3.gather.param_facts`) each time, so
they are true at every point of a step (``ds_status`` is AVAILABLE exactly while the parameter's unit is
gathered). On a parameter stage 3 does not manage they raise AttributeError, so ``hasattr(p, "ds_id")`` - the
test transformers, peft, TRL and Lightning use for "is this a ZeRO-3 parameter" - is False, as without DeepSpeed.
"""
from __future__ import annotations

from enum import Enum
from typing import Callable

import torch

from zero_offload.compat.zero import GatheredParameters, Init
from zero_offload.deepspeed.accelerator import get_accelerator
from zero_offload.zero.stage3 import registry
from zero_offload.zero.stage3.gather import param_facts, register_external_parameter

__all__ = ["ZeroParamStatus", "ZeroParamType", "Init", "GatheredParameters", "register_external_parameter",
           "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor", "get_accelerator",
           "shutdown_init_context", "restore_init_context", "print_rank_0", "PARAM_ATTRIBUTES"]


class ZeroParamType(Enum):
    """DeepSpeed's ``ZeroParamType``."""
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


class ZeroParamStatus(Enum):
    """DeepSpeed's ``ZeroParamStatus``: AVAILABLE while the parameter's whole values are in ``.data``."""
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_orig_torch_arange = torch.arange     # transformers compares constructors with it (prevent_arange_dtype_change)


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: torch.device | None = None) -> Callable:
    """DeepSpeed's wrapper of a tensor constructor under ``zero.Init``: the result on ``target_device`` (default:
    this rank's accelerator), floating results cast to ``target_fp_dtype``. zero-offload's ``Init`` does not
    wrap constructors (a module keeps the dtypes it makes); transformers swaps this function and calls it."""
    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None:
            kwargs["device"] = target_device or torch.device(get_accelerator().current_device_name())
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor
    return wrapped


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Accepted: zero-offload keeps an external parameter registered for the module's life (DeepSpeed drops it)."""


def shutdown_init_context() -> None:
    """DeepSpeed pauses a ``zero.Init`` in progress; zero-offload's sharded build has no global hooks to pause."""


def restore_init_context() -> None:
    """See `shutdown_init_context`."""


def print_rank_0(message, debug: bool = False, force: bool = False) -> None:
    from zero_offload.deepspeed.comm import get_rank
    if get_rank() == 0 and (debug or force):
        print(message)


PARAM_ATTRIBUTES = {
    "ds_id": lambda p, f: registry.order_of(p),       # the same on every rank, as DeepSpeed's
    "ds_status": lambda p, f: ZeroParamStatus.AVAILABLE if f.available else ZeroParamStatus.NOT_AVAILABLE,
    "ds_shape": lambda p, f: torch.Size(f.shape),
    "ds_numel": lambda p, f: f.numel,
    "ds_tensor": lambda p, f: f.local,
    "ds_persist": lambda p, f: f.persistent,
}


def _live(name: str, read) -> property:
    """A property read from the registry. A value set on a tensor is its own and wins: DeepSpeed itself, imported
    in the same process, sets these attributes on the parameters it manages."""
    def get(p):
        own = p.__dict__.get(name, _MISSING)
        if own is not _MISSING:
            return own
        facts = param_facts(p)
        if facts is None:
            raise AttributeError(f"'{type(p).__name__}' object has no attribute '{name}' (not a ZeRO-3 parameter)")
        return read(p, facts)

    def set_(p, value) -> None:
        p.__dict__[name] = value

    def delete(p) -> None:
        if p.__dict__.pop(name, _MISSING) is _MISSING:
            raise AttributeError(name)
    return property(get, set_, delete, doc=f"DeepSpeed's {name}, read from zero-offload's stage-3 registry")


_MISSING = object()


# On torch.Tensor, not only Parameter: under saved-tensor hooks autograd hands backward a plain alias of a saved
# parameter, and backward code reads its attributes too (TRL's chunked log-prob reads weight.ds_status).
for _name, _read in PARAM_ATTRIBUTES.items():
    setattr(torch.Tensor, _name, _live(_name, _read))
