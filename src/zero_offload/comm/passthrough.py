"""User code's torch.distributed collectives, passed through with the engine's hand-over of CPU tensors.

The DeepSpeed face's ``deepspeed.comm`` forwards a script's collectives here, so that on gloo they too never abort at
interpreter exit (`zero_offload.comm.handover`). The engine's own collectives are `zero_offload.comm`'s.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from zero_offload.comm.handover import handed

__all__ = ["torch_collective"]


def _hand_over(arg):
    if isinstance(arg, torch.Tensor):
        return handed(arg)[0]
    if isinstance(arg, (list, tuple)) and arg and all(isinstance(t, torch.Tensor) for t in arg):
        return type(arg)(handed(*arg))
    return arg


def torch_collective(name: str):
    """torch.distributed's collective ``name`` (``all_reduce``, ``send``, ...), called with every CPU tensor
    argument handed over (`zero_offload.comm.handover`): the face DeepSpeed's ``deepspeed.comm`` forwards
    user code's collectives through, so they too never abort at interpreter exit on gloo.

    Raises:
        AttributeError: torch.distributed has no ``name``.
    """
    fn = getattr(dist, name)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*[_hand_over(a) for a in args], **{k: _hand_over(v) for k, v in kwargs.items()})
    return call
