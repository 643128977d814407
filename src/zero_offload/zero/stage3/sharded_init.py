"""Building a model already sharded, with the values its constructor sets (DeepSpeed's ``zero.Init``).

Inside `ShardedInit`, every ``nn.Module`` subclass's ``__init__`` is wrapped: when a module's own
``__init__`` returns (its parameters now hold their constructor values), each of its parameters keeps only
this rank's 1/N slice of its flattened values, and the parameter itself becomes a meta tensor of the same
shape (the same Python object, so ties and references survive). So the whole model never exists on one
rank, and the initial weights are bit-identical to a normal build with the same seed, because the same
constructors draw the same random numbers. `zero_offload.initialize` (stage 3) then assembles each unit
from these slices (`fill_view`). Code that sets values after construction (Hugging Face's
``post_init``) does it under ``gathered_parameters(params, modifier_rank=0)``.
"""
from __future__ import annotations

import functools
import math

import torch

from zero_offload.comm import all_gather_into, broadcast
from zero_offload.zero.stage3 import registry

__all__ = ["ShardedInit", "has_slice", "pop_slices", "fill_view", "open_full", "close_full", "shard_in_place"]

def _rank_world() -> tuple[int, int]:
    from zero_offload.comm import DistContext
    ctx = DistContext.create()                # joins the torchrun group, as initialize will
    return ctx.rank, ctx.world_size


def has_slice(p: torch.Tensor) -> bool:
    return registry.slice_of(p) is not None


def _chunk(numel: int, world: int) -> int:
    return max(1, math.ceil(numel / world))


def _keep_slice(p: torch.nn.Parameter, full: torch.Tensor, rank: int, world: int) -> None:
    chunk = _chunk(full.numel(), world)
    flat = torch.zeros(chunk * world, dtype=full.dtype)
    flat[:full.numel()] = full.detach().reshape(-1).cpu()
    meta = torch.nn.Parameter(torch.empty(full.shape, dtype=full.dtype, device="meta"),
                              requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, meta)
    registry.set_slice(p, (flat[rank * chunk:(rank + 1) * chunk].clone(), rank, world))


def _shard_own(module: torch.nn.Module, rank: int, world: int) -> None:
    for p in module._parameters.values():
        if p is not None and not p.is_meta and not has_slice(p):
            _keep_slice(p, p.data, rank, world)


@torch.no_grad()
def shard_in_place(model: torch.nn.Module) -> None:
    """Turn an already-built model into one built under `ShardedInit` (DeepSpeed's ``zero.Init(module=...)``):
    parameter by parameter, rank 0's values are broadcast (a collective, as DeepSpeed's ``_zero_init_param``)
    and each rank keeps its 1/N slice; the parameter becomes meta, so its full memory is freed at once."""
    rank, world = _rank_world()
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and not p.is_meta and not has_slice(p):
                full = p.data
                if world > 1:
                    full = full.detach().contiguous().cpu()
                    broadcast(full, 0)
                _keep_slice(p, full, rank, world)


def _gather(state, shape, numel) -> torch.Tensor:
    piece, _, world = state
    if world > 1:
        full = torch.empty(piece.numel() * world, dtype=piece.dtype)
        all_gather_into(full, piece)
    else:
        full = piece
    return full[:numel].view(shape)


def pop_slices(params) -> dict[int, tuple]:
    """{id(parameter): its slice state} for the parameters built under `ShardedInit`, taken out of the
    registry (the parameters are swapped for materialised ones next)."""
    return {id(p): registry.pop_slice(p) for p in params if has_slice(p)}


@torch.no_grad()
def fill_view(state: tuple, view: torch.Tensor) -> None:
    """Write a parameter's constructor values (its popped slice ``state``) into ``view`` (a collective)."""
    view.copy_(_gather(state, view.shape, view.numel()).to(view.device, view.dtype))


@torch.no_grad()
def open_full(p: torch.nn.Parameter) -> tuple:
    """Give a parameter built under `ShardedInit` its full values (a collective); returns the state for
    `close_full`."""
    state = registry.pop_slice(p)
    full = _gather(state, p.shape, p.numel()).clone()
    torch.utils.swap_tensors(p, torch.nn.Parameter(full, requires_grad=p.requires_grad))
    return state


@torch.no_grad()
def close_full(p: torch.nn.Parameter, state: tuple, src_rank: int | None) -> None:
    """Back to a slice: rank ``src_rank``'s values broadcast and kept, or (None) the old slice kept."""
    piece, rank, world = state
    if src_rank is None:
        meta = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                  requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, meta)
        registry.set_slice(p, state)
        return
    full = p.data.detach().contiguous().cpu()
    if world > 1:
        broadcast(full, src_rank)
    _keep_slice(p, full, rank, world)


def _subclasses(cls):
    seen, todo = set(), [cls]
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(c.__subclasses__())
    return seen


class ShardedInit:
    """The context manager behind `zero_offload.init_sharded` / ``deepspeed.zero.Init``."""

    def __init__(self):
        self._patched: list[tuple[type, object]] = []

    def __enter__(self):
        rank, world = _rank_world()
        for cls in _subclasses(torch.nn.Module):
            self._patch(cls, rank, world)
        # Classes defined inside the context (a lazily imported model file) are wrapped as they are made.
        self._had_hook = "__init_subclass__" in torch.nn.Module.__dict__
        self._orig_hook = torch.nn.Module.__dict__.get("__init_subclass__")
        patch = self._patch

        def __init_subclass__(cls, **kwargs):   # noqa: N807
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            patch(cls, rank, world)
        torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        return self

    def _patch(self, cls, rank: int, world: int) -> None:
        if "__init__" in cls.__dict__:
            orig = cls.__dict__["__init__"]
            cls.__init__ = self._wrap(orig, rank, world)
            self._patched.append((cls, orig))

    @staticmethod
    def _wrap(orig, rank: int, world: int):
        @functools.wraps(orig)
        def __init__(module, *args, **kwargs):   # noqa: N807
            depth = registry.init_depth(module)
            registry.set_init_depth(module, depth + 1)
            try:
                orig(module, *args, **kwargs)
            finally:
                registry.set_init_depth(module, depth)
            if depth == 0:              # this module's whole __init__ (its subclasses' included) is done
                _shard_own(module, rank, world)
        return __init__

    def __exit__(self, *exc):
        if self._had_hook:
            torch.nn.Module.__init_subclass__ = self._orig_hook
        else:
            del torch.nn.Module.__init_subclass__
        for cls, orig in reversed(self._patched):
            cls.__init__ = orig
        self._patched.clear()
        return False
