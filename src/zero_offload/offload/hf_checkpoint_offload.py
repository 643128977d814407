"""transformers' own ``activation_checkpointing_enable(offload=True)``, taken over by the engine's checkpoint offload.

transformers 5 wraps each checkpointed layer's call in ``torch.autograd.graph.save_on_cpu(pin_memory=True)``:
every tensor the checkpoint saves is copied to pinned host memory on the compute stream, so the step waits for
each copy, and the engine's own saved-tensors hook (`zero_offload.offload.checkpoint_offload`) never sees them.
Under the engine that wrapper is replaced by the plain checkpoint with the same keyword arguments, and the engine
moves the same inputs on its copy streams instead (overlapped, pooled, prefetched); training is bitwise the same.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["take_over"]


def _is_hf_offload(fn) -> bool:
    """``fn`` is transformers' ``checkpoint_func`` (its offload wrapper), bound with the checkpoint's kwargs."""
    inner = getattr(fn, "func", None)
    code = getattr(inner, "__code__", None)
    return (isinstance(fn, functools.partial) and code is not None and inner.__name__ == "checkpoint_func"
            and "save_on_cpu" in code.co_names and (inner.__module__ or "").startswith("transformers"))


def take_over(model: torch.nn.Module) -> bool:
    """Replace every ``_gradient_checkpointing_func`` of ``model`` that transformers' ``offload=True`` set by the plain
    ``torch.utils.checkpoint.checkpoint`` with the same keyword arguments; True when any was (the engine then
    offloads checkpoint inputs itself)."""
    taken = False
    for module in model.modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if _is_hf_offload(fn):
            module._gradient_checkpointing_func = functools.partial(checkpoint, **fn.keywords)
            taken = True
    return taken
