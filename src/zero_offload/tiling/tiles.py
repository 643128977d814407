"""What the three sequence-tiled autograd functions share: checking their arguments, cutting a length into tiles,
agreeing the tile count across ranks, and collecting each parameter's gradient over the tiles so that it reaches the
parameter once.

Tiles follow ``torch.chunk``'s cut, as DeepSpeed 0.19.8's ``ulysses_sp`` does: tiles of ``ceil(n / shards)`` rows,
the last one shorter, and none left when ``n`` runs out first (``chunk`` returns fewer than ``shards`` pieces then).

Gradients: the tiles' backward runs ``torch.autograd.grad`` on each tile's recomputed forward, so nothing reaches a
parameter's ``.grad`` (and no ZeRO gradient hook fires) while the tiles run; the sums are handed over once at the
end (`GradSums`). DeepSpeed instead lets every tile accumulate into ``.grad`` and tells its ZeRO to wait through
each parameter's ``ds_grad_is_ready`` flag.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from zero_offload.comm import all_gather_into
from zero_offload.zero.stage3 import registry

__all__ = ["check_shards", "tile_bounds", "Candidates", "candidate_params", "agree_tile_count", "needs_agreement",
           "GradSums", "SharedGradientError", "watch", "leaf_tile", "graph_leaves", "distributed"]


def check_shards(shards, name: str = "shards") -> int:
    """``shards`` as an int >= 1 (given as an int or a 0-d integer tensor).

    Raises:
        TypeError: not an integer (names ``name``).
        ValueError: below 1 (names ``name``).
    """
    if isinstance(shards, bool):
        raise TypeError(f"{name} must be an int >= 1, got {shards!r}")
    try:
        value = operator.index(shards)
    except TypeError:
        raise TypeError(f"{name} must be an int >= 1 (the number of tiles), got {type(shards).__name__} "
                        f"{shards!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (the number of tiles), got {value}")
    return value


def tile_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """Exactly ``shards`` half-open row ranges ``(lo, hi)`` covering ``range(n)`` in order: ``torch.chunk``'s
    tiles of ``ceil(n / shards)`` rows, then empty ranges at ``n`` where ``chunk`` would stop early."""
    step = math.ceil(n / shards) if n else 0
    return [(min(i * step, n), min((i + 1) * step, n)) for i in range(shards)]


@dataclass
class Candidates:
    """The parameters a tiled call may touch (see `candidate_params`)."""
    every: list[torch.Tensor]        # compute_params and the module's parameters that require a gradient
    inputs: list[torch.Tensor]       # of compute_params, those with their values present: the node's inputs
    specs: list[tuple]               # each input's (shape, dtype, device) at the call


def candidate_params(module, compute_params, name: str = "compute_params") -> Candidates:
    """The tensors that may take part in a tiled compute and need a gradient: ``compute_params`` (DeepSpeed's list,
    which may be None) and, when ``module`` is an ``nn.Module``, its parameters; each once, in that order.

    The inputs of the autograd node are the ``compute_params`` whose values are present now (a stage-3 parameter
    not gathered has none: its gradient could not be checked against its shape): autograd then accumulates their
    summed tile gradients together with any other use of them, in one step. A module's other parameters are not
    inputs, since an input that gets no gradient still fires its post-accumulate-grad hooks (ZeRO's) with none;
    every candidate that is not an input is watched (`watch`). Flags and shapes are read with torch functions off,
    so that stage 3's watch for parameters read outside their module (`zero_offload.zero.stage3.stray_reads`)
    does not gather them for it.

    Raises:
        TypeError: ``compute_params`` is neither None nor an iterable of tensors (names ``name``).
    """
    listed: dict[int, torch.Tensor] = {}
    if compute_params is not None:
        if isinstance(compute_params, torch.Tensor) or not isinstance(compute_params, Iterable):
            raise TypeError(f"{name} must be a list of tensors or None, got {type(compute_params).__name__}")
        for p in compute_params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{name} must hold tensors only, got a {type(p).__name__}")
            listed.setdefault(id(p), p)
    found = dict(listed)
    if isinstance(module, torch.nn.Module):
        for p in module.parameters():
            found.setdefault(id(p), p)
    with torch._C.DisableTorchFunction():
        every = [p for p in found.values() if p.requires_grad]
        inputs = [p for p in every if id(p) in listed and p.numel() > 0]
        specs = [(p.shape, p.dtype, p.device) for p in inputs]
    kept = {id(p) for p in inputs}
    watch(p for p in every if id(p) not in kept)
    return Candidates(every, inputs, specs)


def distributed() -> bool:
    """Whether this process is one of several ranks of a default process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def needs_agreement(candidates: list[torch.Tensor]) -> bool:
    """Whether the ranks must agree on a tile count: several ranks, and the tiles may run stage-3 modules, whose
    parameter gathers are collectives issued per module call (some candidate is held by a stage-3 engine, or there
    is none to tell). Otherwise each rank tiles alone, as under DeepSpeed, and may call the function a different
    number of times."""
    if not distributed():
        return False
    return not candidates or any(registry.owner_of(p) is not None for p in candidates)


def agree_tile_count(shards: int, group=None) -> int:
    """The largest ``shards`` any rank of ``group`` (default: every rank) asks for, on every rank: DeepSpeed's
    ``dist.all_reduce(MAX)`` of its Llama example, as an all-gather through `zero_offload.comm`. A collective:
    every rank must call it. ``shards`` itself on a single process.

    Raises:
        TypeError, ValueError: see `check_shards`.
    """
    shards = check_shards(shards)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return shards
    every = torch.zeros(dist.get_world_size(group), dtype=torch.int64)
    all_gather_into(every, torch.tensor([shards], dtype=torch.int64), group)
    return int(every.max())


def graph_leaves(out: torch.Tensor, skip: torch.Tensor | None) -> list[torch.Tensor]:
    """The leaf tensors that ``out``'s graph accumulates a gradient into (autograd's ``AccumulateGrad`` nodes),
    ``skip`` left out, in a fixed order (depth first from ``out``)."""
    found, seen, stack = {}, set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            if leaf is not skip:
                found.setdefault(id(leaf), leaf)
            continue
        stack.extend(n for n, _ in reversed(node.next_functions))
    return list(found.values())


class SharedGradientError(RuntimeError):
    """A parameter handed its tiled gradient outside autograd's graph also got a gradient from the rest of the
    graph in the same backward (a tied weight): ZeRO would reduce it twice."""


# Parameters whose tiled gradient was handed over by a backward of its own (see `GradSums.finish`): the graph
# task of the latest gradient each one got, the outer backward it was handed over in, and the watching hook.
_LAST_GRADIENT = WeakIdKeyDictionary()
_HANDED_IN = WeakIdKeyDictionary()
_WATCHED = WeakIdKeyDictionary()


def _current_task() -> int:
    return torch._C._current_graph_task_id()


def _on_gradient(p: torch.Tensor) -> None:
    task = _current_task()
    if _HANDED_IN.get(p) == task:
        raise SharedGradientError(_shared_message(p))
    _LAST_GRADIENT[p] = task


def watch(params) -> None:
    """Watch each of ``params`` for gradients from the rest of the graph (once per parameter, for its life): a
    parameter whose tiled gradient `GradSums.finish` hands over by a backward of its own must get no other in the
    same backward. Watched from the call of the tiled function on, both orders are caught; a parameter first met in
    backward (reached only through ``fn``'s closure) is caught from its second backward on where the rest of the
    graph feeds it before the tiles do."""
    for p in params:
        if p not in _WATCHED:
            _WATCHED[p] = p.register_post_accumulate_grad_hook(_on_gradient)


def _shared_message(p: torch.Tensor) -> str:
    return (f"a parameter of shape {tuple(p.shape)} used by a sequence-tiled compute gets a gradient from the "
            "rest of the model too (a tied weight), and it was not among the function's inputs: name it in "
            "compute_params (or pass its module as `self`), and under ZeRO stage 3 have it gathered when the "
            "function is called (e.g. stage3_param_persistence_threshold above its size)")


class GradSums:
    """Per-parameter gradient sums over the tiles of one backward.

    ``inputs``: the parameters that are inputs of the autograd function, with their ``specs`` (shape, dtype,
    device) at the call: their sums are returned by `finish`, for autograd to accumulate with the rest of the
    graph's contributions in one step. Any other leaf a tile's
    graph reaches is summed too and handed to its ``.grad`` by one ``torch.autograd.backward`` at `finish`, so a
    post-accumulate-grad hook (ZeRO's) fires once for it. 16-bit gradients are summed in fp32.
    """

    def __init__(self, inputs: list[torch.Tensor], specs: list[tuple]):
        self.inputs, self.specs = inputs, specs
        self.sums: dict[int, list] = {}          # id -> [leaf, sum, owned]

    def tile(self, run, x_tile: torch.Tensor | None, grad_out: torch.Tensor) -> torch.Tensor | None:
        """Recompute one tile (``run()`` under grad), add its parameter gradients for ``grad_out`` to the sums and
        return the gradient of ``x_tile`` (None where it needs none)."""
        with torch.enable_grad():
            out = run()
        wants_x = x_tile is not None and x_tile.requires_grad
        if not out.requires_grad:
            return torch.zeros_like(x_tile) if wants_x else None
        leaves = graph_leaves(out, x_tile)
        wanted = ([x_tile] if wants_x else []) + leaves
        if not wanted:
            return None
        got = torch.autograd.grad(out, wanted, grad_out.to(out.dtype).expand_as(out), allow_unused=True)
        for leaf, g in zip(leaves, got[1:] if wants_x else got):
            if g is not None:
                self.add(leaf, g)
        if not wants_x:
            return None
        return got[0] if got[0] is not None else torch.zeros_like(x_tile)

    def add(self, leaf: torch.Tensor, g: torch.Tensor) -> None:
        entry = self.sums.get(id(leaf))
        if entry is None:
            if g.dtype in (torch.float16, torch.bfloat16):
                self.sums[id(leaf)] = [leaf, g.float(), True]
            else:
                self.sums[id(leaf)] = [leaf, g, False]     # autograd's tensor: may alias the incoming gradient
        elif entry[2]:
            entry[1].add_(g)
        else:
            entry[1], entry[2] = entry[1] + g, True

    def finish(self) -> list[torch.Tensor | None]:
        """Hand the sums over: returns the gradient of each of ``inputs`` in its dtype (zeros where the tiles did not
        use it: autograd would fire its hooks with no gradient for None); every other leaf gets its sum now, by one
        backward of its own.

        Raises:
            SharedGradientError: such a leaf already got a gradient from the rest of the graph in this backward.
        """
        cast = {i: (e[0], e[1].to(e[0].dtype)) for i, e in self.sums.items()}
        returned = [cast.pop(id(p))[1] if id(p) in cast else torch.zeros(shape, dtype=dtype, device=device)
                    for p, (shape, dtype, device) in zip(self.inputs, self.specs)]
        if cast:
            outer = _current_task()
            leaves = [leaf for leaf, _ in cast.values()]
            for leaf in leaves:
                if _LAST_GRADIENT.get(leaf) == outer:
                    raise SharedGradientError(_shared_message(leaf))
                _HANDED_IN[leaf] = outer
            watch(leaves)
            torch.autograd.backward(leaves, [g for _, g in cast.values()])
        self.sums.clear()
        return returned


def leaf_tile(t: torch.Tensor, lo: int, hi: int, dim: int, requires_grad: bool) -> torch.Tensor:
    """Rows ``lo:hi`` of ``t`` along ``dim``, detached from the caller's graph (a leaf that requires a gradient
    when ``requires_grad``)."""
    return t.narrow(dim, lo, hi - lo).detach().requires_grad_(requires_grad)
