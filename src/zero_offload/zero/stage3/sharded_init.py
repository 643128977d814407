"""Building a model already sharded, with the values its constructor sets (DeepSpeed's ``zero.Init``).

Inside `ShardedInit` every ``nn.Module`` subclass's ``__init__`` is wrapped: when a module's own ``__init__``
returns, each of its parameters keeps only this rank's 1/N slice of its flattened values and becomes a meta tensor of
the same shape (the same Python object, so ties survive); `zero_offload.initialize` (stage 3) assembles each unit
from the slices (`fill_view`). Writes into parameters already sharded (a parent's ``self.apply(self._init_weights)``,
Hugging Face's ``post_init()``) are kept by a torch function mode (`WriteThrough`): each runs on the gathered full
values and rank 0's result is sliced again, where DeepSpeed 0.19.8's ``apply_with_gather`` does so per
``Module.apply`` call (docs/library.md). The same constructors draw the same random numbers in the same order, so the
weights are bit-identical to a normal build with the same seed. Each such write is a collective: every rank must run
the same constructors, as under DeepSpeed.
"""
from __future__ import annotations

import functools
import math

import torch
from torch.overrides import TorchFunctionMode

from zero_offload.comm import all_gather_into, broadcast
from zero_offload.zero.stage3 import registry
from zero_offload.zero.stage3.swap import swap_keeping_attributes

__all__ = ["ShardedInit", "has_slice", "pop_slices", "fill_view", "open_full", "close_full", "shard_in_place",
           "WriteThrough", "rank_world", "slice_bounds", "adopt_slice"]


def rank_world() -> tuple[int, int]:
    """(data-parallel rank, world size), joining the torchrun group as `zero_offload.initialize` will."""
    from zero_offload.comm import DistContext
    ctx = DistContext.create()
    return ctx.rank, ctx.world_size


def has_slice(p: torch.Tensor) -> bool:
    return registry.slice_of(p) is not None


def _chunk(numel: int, world: int) -> int:
    return max(1, math.ceil(numel / world))


def slice_bounds(numel: int, rank: int, world: int) -> tuple[int, int]:
    """``[lo, hi)``: the elements of a flattened ``numel``-element parameter that are ``rank``'s slice (the
    flattened values cut in ``world`` chunks of ceil(numel / world), the last padded with zeros); ``hi`` is
    clipped to ``numel``, so the range is empty on a rank that holds only padding."""
    chunk = _chunk(numel, world)
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def adopt_slice(p: torch.nn.Parameter, rank: int, world: int) -> torch.Tensor:
    """Make the meta parameter ``p`` one built under `ShardedInit` and return its slice to fill: 1-D, ``p``'s
    dtype, zeros, one chunk long; the first ``hi - lo`` elements (`slice_bounds`) are ``rank``'s values, the
    rest padding.

    Raises:
        ValueError: ``p`` is not a meta tensor.
    """
    if not p.is_meta:
        raise ValueError(f"adopt_slice needs a meta parameter; got one on {p.device}")
    piece = _piece(p.numel(), p.dtype, world)
    registry.set_slice(p, (piece, rank, world))
    return piece


def _piece(numel: int, dtype: torch.dtype, world: int) -> torch.Tensor:
    """A rank's slice of a ``numel``-element parameter before it is filled: one chunk of zeros (the padding)."""
    return torch.zeros(_chunk(numel, world), dtype=dtype)


def _slice(full: torch.Tensor, rank: int, world: int) -> tuple:
    lo, hi = slice_bounds(full.numel(), rank, world)
    piece = _piece(full.numel(), full.dtype, world)
    piece[:hi - lo] = full.detach().reshape(-1)[lo:hi]
    return piece, rank, world


def _to_meta(p: torch.nn.Parameter, like: torch.Tensor, state: tuple) -> None:
    """Swap ``p`` for a meta parameter of ``like``'s shape and dtype whose values are the slice ``state``."""
    meta = torch.empty(like.shape, dtype=like.dtype, device="meta")
    swap_keeping_attributes(p, torch.nn.Parameter(meta, requires_grad=p.requires_grad))
    registry.set_slice(p, state)


def _shard_own(module: torch.nn.Module, rank: int, world: int, from_rank0: bool = False) -> None:
    for p in module._parameters.values():
        if p is not None and not p.is_meta and not has_slice(p):
            full = p.data
            if from_rank0 and world > 1:
                full = full.detach().contiguous().cpu()
                broadcast(full, 0)
            _to_meta(p, full, _slice(full, rank, world))


@torch.no_grad()
def shard_in_place(model: torch.nn.Module) -> None:
    """Turn an already-built model into one built under `ShardedInit` (DeepSpeed's ``zero.Init(module=...)``):
    parameter by parameter, rank 0's values are broadcast (a collective, as DeepSpeed's ``_zero_init_param``)
    and each rank keeps its 1/N slice; the parameter becomes meta, so its full memory is freed at once."""
    rank, world = rank_world()
    for module in model.modules():
        _shard_own(module, rank, world, from_rank0=True)


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
    """Give a parameter built under `ShardedInit` its full values (a collective); returns `close_full`'s state."""
    state = registry.pop_slice(p)
    full = _gather(state, p.shape, p.numel()).clone()
    swap_keeping_attributes(p, torch.nn.Parameter(full, requires_grad=p.requires_grad))
    return state


@torch.no_grad()
def close_full(p: torch.nn.Parameter, state: tuple, src_rank: int | None) -> None:
    """Back to a slice: rank ``src_rank``'s values broadcast and kept, or (None) the old slice kept."""
    piece, rank, world = state
    if src_rank is None:
        _to_meta(p, p, state)
        return
    full = p.data.detach().contiguous().cpu()
    if world > 1:
        broadcast(full, src_rank)
    _to_meta(p, full, _slice(full, rank, world))


_DATA = torch.Tensor.data        # the getset descriptor behind ``p.data`` and ``p.data = t``
_VIEWS = frozenset({"__getitem__", "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "narrow",
                    "select", "t", "transpose", "permute", "squeeze", "unsqueeze", "detach"})
_IN_PLACE_OPERATORS = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                                       "and", "or", "xor", "lshift", "rshift", "matmul"))
_METADATA_ONLY = frozenset({"requires_grad_", "share_memory_", "retain_grad", "detach_", "rename_", "resize_",
                            "resize_as_", "set_", "as_strided_", "record_stream"})


def _is_write(name: str) -> bool:
    if name == "__setitem__" or name in _IN_PLACE_OPERATORS:
        return True
    return name.endswith("_") and not name.startswith("_") and name not in _METADATA_ONLY


def _target(t) -> tuple | None:
    """``(parameter, view fn or None)`` when ``t`` is a sharded parameter or a view of one, else None."""
    if not isinstance(t, torch.Tensor):
        return None
    if has_slice(t):
        return t, None
    alias = registry.alias_of(t)
    if alias is not None and has_slice(alias[0]):
        return alias
    return None


class WriteThrough(TorchFunctionMode):
    """The torch function mode `ShardedInit` holds open: in-place writes into sharded parameters (or views of
    them) run on the gathered full values and are sliced again, rank 0's values kept (see the module
    docstring). Every other call passes through unchanged (reads of a sharded parameter stay meta)."""

    def __init__(self, rank: int, world: int):
        super().__init__()
        self.rank, self.world, self.busy = rank, world, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.busy or not args and not kwargs:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        attr = None                       # the tensor attribute when func is a descriptor's __get__/__set__
        if name in ("__get__", "__set__") and isinstance(getattr(func, "__self__", None), type(_DATA)):
            attr = func.__self__.__name__
        if attr == "data" and name == "__set__":
            return self._set_data(func, args)
        if attr in ("data", "T", "mT") and name == "__get__" or attr is None and name in _VIEWS:
            return self._view(func, args, kwargs, attr == "data")
        if attr is None and _is_write(name):
            return self._write(func, args, kwargs)
        return func(*args, **kwargs)

    def _view(self, func, args, kwargs, same: bool):
        out = func(*args, **kwargs)
        hit = _target(args[0]) if args else None
        if hit is not None and isinstance(out, torch.Tensor):
            p, inner = hit
            if same:
                fn = inner
            else:
                rest = args[1:]

                def fn(full, inner=inner, rest=rest):
                    return func(full if inner is None else inner(full), *rest, **kwargs)
            registry.set_alias(out, (p, fn))
        return out

    def _write(self, func, args, kwargs):
        target = args[0] if args else kwargs.get("tensor")
        if not any(_target(a) for a in (*args, *kwargs.values())):
            return func(*args, **kwargs)
        self.busy = True
        try:
            fulls: dict[int, torch.Tensor] = {}

            def sub(t):
                hit = _target(t)
                if hit is None:
                    return t
                p, fn = hit
                if id(p) not in fulls:
                    fulls[id(p)] = _gather(registry.slice_of(p), p.shape, p.numel()).clone()
                return fulls[id(p)] if fn is None else fn(fulls[id(p)])
            new_target = sub(target)
            out = func(*[sub(a) for a in args], **{k: sub(v) for k, v in kwargs.items()})
            hit = _target(target)
            if hit is not None:
                self._keep(hit[0], fulls[id(hit[0])])
        finally:
            self.busy = False
        return target if out is new_target or out is fulls.get(id(target)) else out

    def _set_data(self, func, args):
        p, value = args
        if has_slice(p) and isinstance(value, torch.Tensor) and not value.is_meta:
            self.busy = True
            try:
                func(p, torch.empty(value.shape, dtype=value.dtype, device="meta"))
                self._keep(p, value.detach().cpu().contiguous().clone())
            finally:
                self.busy = False
            return None
        return func(*args)

    def _keep(self, p: torch.Tensor, full: torch.Tensor) -> None:
        if self.world > 1:
            broadcast(full, 0)            # rank 0's values, as DeepSpeed's apply_with_gather
        registry.set_slice(p, _slice(full, self.rank, self.world))


def _subclasses(cls):
    seen, todo = set(), [cls]
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(c.__subclasses__())
    return seen


class ShardedInit:
    """The context manager behind `zero_offload.init_sharded` / ``deepspeed.zero.Init``; ``on_built(module)`` is
    called for each module whose whole ``__init__`` ran inside, after its parameters were sharded."""

    def __init__(self, on_built=None):
        self._patched: list[tuple[type, object]] = []
        self._on_built = on_built

    def __enter__(self):
        rank, world = rank_world()
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
        self._mode = WriteThrough(rank, world)
        self._mode.__enter__()
        return self

    def _patch(self, cls, rank: int, world: int) -> None:
        if "__init__" in cls.__dict__:
            orig = cls.__dict__["__init__"]
            cls.__init__ = self._wrap(orig, rank, world)
            self._patched.append((cls, orig))

    def _wrap(self, orig, rank: int, world: int):
        on_built = self._on_built

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
                if on_built is not None:
                    on_built(module)
        return __init__

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        if self._had_hook:
            torch.nn.Module.__init_subclass__ = self._orig_hook
        else:
            del torch.nn.Module.__init_subclass__
        for cls, orig in reversed(self._patched):
            cls.__init__ = orig
        self._patched.clear()
        return False
