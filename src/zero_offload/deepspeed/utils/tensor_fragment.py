"""``deepspeed.utils.tensor_fragment``: one parameter's fp32 weights, optimizer state and gradient, whole
(``safe_get_full_*``, collectives where the state is partitioned) or this rank's part (``safe_get_local_*``).

Mirrors DeepSpeed 0.19.8: each returns None for a parameter no engine trains. The fp32 weights and optimizer
states come from the engine's partitions (`zero_offload.compat.param_state`); so does the gradient, from the
reduced gradient partitions (DeepSpeed returns ``param.grad`` first; here ``.grad`` is not the reduced gradient,
which goes into the partitions). Setting a gradient held in partitions is not built.
"""
from __future__ import annotations

import torch

from zero_offload.compat import param_state
from zero_offload.compat.unbuilt import NotBuiltError

__all__ = ["safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad", "safe_get_local_fp32_param",
           "safe_set_local_fp32_param", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
           "safe_get_local_grad", "safe_set_local_grad"]


def _get(param, kind: str, full: bool):
    engine = param_state.engine_of(param)
    if engine is None:
        return None
    reader = param_state.full_state if full else param_state.local_state
    out = reader(engine, param, kind)
    return None if out is None else out.to(engine.device)


def _set(param, value, kind: str, full: bool) -> None:
    engine = param_state.engine_of(param)
    if engine is None:
        raise ValueError("safe_set_*: no zero-offload engine trains this parameter")
    (param_state.set_full_state if full else param_state.set_local_state)(engine, param, kind, value)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master weight of ``param`` (its shape, on the engine's device), or None."""
    return _get(param, "master", True)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace ``param``'s fp32 master weight with ``value`` (its full shape); the 16-bit parameter follows."""
    _set(param, value, "master", True)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole ``optim_state_key`` (``exp_avg``, ``exp_avg_sq``) of ``param``, or None."""
    return _get(param, optim_state_key, True)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    _set(param, value, optim_state_key, True)


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of ``param``'s fp32 master weight, 1-D, or None."""
    return _get(param, "master", False)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    _set(param, value, "master", False)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    return _get(param, optim_state_key, False)


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    _set(param, value, optim_state_key, False)


def _grad(param, full: bool):
    engine = param_state.engine_of(param)
    if engine is None:
        return param.grad

    return (param_state.full_grad if full else param_state.local_grad)(engine, param)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """``param.grad`` where it holds the gradient (stage 0), as DeepSpeed returns it first; else the reduced
    gradient assembled from the ranks' partitions (stages 1-3, between the boundary backward and ``step``; a
    collective); None for a parameter no engine trains."""
    return _grad(param, full=True)


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of the reduced gradient (1-D), or ``param.grad``; see `safe_get_full_grad`."""
    return _grad(param, full=False)


def _set_grad_not_built(param) -> None:
    if param_state.engine_of(param) is not None:
        raise NotBuiltError("safe_set_full_grad/safe_set_local_grad of a gradient held in the engine's reduced "
                            "partitions is not built in zero-offload: the global norm is summed as the gradient "
                            "lands; change the loss instead")


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Raises: NotBuiltError: a parameter an engine trains (`_set_grad_not_built`)."""
    _set_grad_not_built(param)
    param.grad.copy_(value)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Raises: NotBuiltError: a parameter an engine trains."""
    _set_grad_not_built(param)
    param.grad.copy_(value)
