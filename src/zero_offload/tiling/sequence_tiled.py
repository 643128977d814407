"""`SequenceTiledCompute` and `sequence_tiled_compute`: any function of tensors ``[batch, seqlen, ...]`` computed a
tile of the sequence at a time, forward and backward (DeepSpeed 0.19.8's
``deepspeed.runtime.sequence_parallel.ulysses_sp.SequenceTiledCompute`` and ``sequence_tiled_compute``; ALST,
arXiv 2506.13996). `TiledMLP` and `TiledFusedLogitsLoss` are its two common cases, spelled out.
"""
from __future__ import annotations

import math
import operator

import torch

from zero_offload.tiling.tiles import (GradSums, agree_tile_count, candidate_params, check_shards, leaf_tile,
                                       needs_agreement)

__all__ = ["SequenceTiledCompute", "sequence_tiled_compute"]

REDUCTIONS = (None, "mean", "sum")
FIXED = 12      # forward's arguments before the tensors: fn ... output_reduction (9), agree, specs, count


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension=1, output_reduction="mean"):
    """``fn(**tiles_of(kwargs_to_shard), **kwargs_to_pass)`` over ``shards`` tiles of the sequence, joined (and
    reduced) as DeepSpeed 0.19.8's ``sequence_tiled_compute`` does; see `SequenceTiledCompute` for the arguments.

    Raises:
        TypeError: ``kwargs_to_shard`` or ``kwargs_to_pass`` not a dict (names it); see `SequenceTiledCompute`.
    """
    for name, value in (("kwargs_to_shard", kwargs_to_shard), ("kwargs_to_pass", kwargs_to_pass)):
        if not isinstance(value, dict):
            raise TypeError(f"sequence_tiled_compute: {name} must be a dict, got {type(value).__name__}")
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class SequenceTiledCompute(torch.autograd.Function):
    """``SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
    compute_params, output_unshard_dimension, output_reduction, *args)``, DeepSpeed 0.19.8's arguments and result.

    Args:
        fn: called as ``fn(**{key: tile}, **passed)`` once per tile, ``shards`` times (an empty tile included
            where the sequence runs out first, as in DeepSpeed).
        seqlen: the sequence length: dimension 1 of every tensor to tile.
        shards: the number of tiles, an int >= 1, each ``ceil(seqlen / shards)`` long (the last shorter). Under
            ZeRO stage 3 on several ranks, the largest any rank asks for (see `TiledMLP`).
        keys_to_shard, keys_to_pass: the names of ``args``, in order: first the tensors ``[batch, seqlen, ...]``
            that are tiled along dimension 1, then the values passed whole.
        grad_requiring_tensor_key: the one tiled tensor that gets a gradient (the others and the passed values get
            none, as in DeepSpeed).
        compute_params: the parameters ``fn`` uses, or None (see `TiledMLP`: each gradient arrives once).
        output_unshard_dimension: 0: each tile's result is a loss, stacked into ``[shards, ...]``; otherwise the
            tiles' results are concatenated along this dimension.
        output_reduction: None (the joined results), ``"mean"`` or ``"sum"`` of them.

    Returns:
        The joined tiles' results, or their mean or sum (0-d), in ``fn``'s dtype.

    Raises:
        ValueError: ``output_reduction`` not None/"mean"/"sum"; ``shards`` < 1; ``seqlen`` < 0;
            ``grad_requiring_tensor_key`` not in ``keys_to_shard``; a tensor to tile that is not ``[batch,
            seqlen, ...]``; as many ``args`` as keys not given (each names the argument).
        TypeError: ``shards``, ``seqlen`` or ``output_unshard_dimension`` not an int; ``compute_params`` not a list
            of tensors; a value to tile not a tensor.
        SharedGradientError: see `TiledMLP`.

    Where DeepSpeed differs: with ``output_reduction="mean"`` and a dimension other than 0, its backward divides the
    0-d incoming gradient by ``shards`` and then fails to slice it; here the mean's gradient is the incoming one
    divided by the number of elements joined, for every dimension.
    """

    @classmethod
    def apply(cls, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
              output_unshard_dimension, output_reduction, *args):
        if not callable(fn):
            raise TypeError(f"SequenceTiledCompute: fn must be callable, got {type(fn).__name__}")
        keys_to_shard, keys_to_pass = list(keys_to_shard), list(keys_to_pass)
        check_tiling(seqlen, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, output_unshard_dimension,
                     output_reduction, args)
        shards = check_shards(shards)
        candidates = candidate_params(None, compute_params)
        agree = needs_agreement(candidates.every)
        if agree:
            shards = agree_tile_count(shards)
        return super().apply(fn, operator.index(seqlen), shards, keys_to_shard, keys_to_pass,
                             grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction,
                             agree, candidates.specs, len(args), *args, *candidates.inputs)

    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
                output_unshard_dimension, output_reduction, agree, specs, count, *rest):
        args, ctx.params, ctx.specs = rest[:count], rest[count:], specs
        ctx.fn, ctx.keys_to_shard, ctx.keys_to_pass = fn, keys_to_shard, keys_to_pass
        ctx.key, ctx.dim = grad_requiring_tensor_key, output_unshard_dimension
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        step = math.ceil(seqlen / shards)
        ctx.bounds = [(min(i * step, seqlen), min((i + 1) * step, seqlen)) for i in range(shards)]
        sharded, passed = split_args(keys_to_shard, keys_to_pass, args)
        outputs = [fn(**{k: v[:, lo:hi] for k, v in sharded.items()}, **passed) for lo, hi in ctx.bounds]
        if output_unshard_dimension == 0:
            joined = torch.cat([out.unsqueeze(0) for out in outputs], dim=0)
        else:
            joined = torch.cat(outputs, dim=output_unshard_dimension)
            ctx.sizes = [out.shape[output_unshard_dimension] for out in outputs]
        ctx.reduction, ctx.numel = output_reduction, joined.numel()
        if output_reduction is None:
            return joined
        return joined.mean() if output_reduction == "mean" else joined.sum()

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[i] = t
        sharded, passed = split_args(ctx.keys_to_shard, ctx.keys_to_pass, args)
        sharded = {k: v.detach() for k, v in sharded.items()}
        passed = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in passed.items()}
        position = ctx.keys_to_shard.index(ctx.key)
        wants_x = ctx.needs_input_grad[FIXED + position]
        x = sharded[ctx.key]
        x_grad = torch.zeros_like(x) if wants_x else None
        incoming = grads[0]
        if ctx.reduction == "mean":
            incoming = incoming / ctx.numel
        sums = GradSums(list(ctx.params), ctx.specs)
        offset = 0
        for i, (lo, hi) in enumerate(ctx.bounds):
            tiles = {k: v[:, lo:hi] for k, v in sharded.items()}
            tiles[ctx.key] = x_tile = leaf_tile(x, lo, hi, 1, wants_x)
            if ctx.reduction is not None:
                grad_out = incoming
            elif ctx.dim == 0:
                grad_out = incoming[i]
            else:
                grad_out = incoming.narrow(ctx.dim, offset, ctx.sizes[i])
                offset += ctx.sizes[i]
            g = sums.tile(lambda: ctx.fn(**tiles, **passed), x_tile if wants_x else None, grad_out)
            if wants_x:
                x_grad[:, lo:hi] = g
        param_grads = sums.finish()
        arg_grads = [None] * len(args)
        arg_grads[position] = x_grad
        return (None,) * FIXED + tuple(arg_grads) + tuple(param_grads)


def split_args(keys_to_shard, keys_to_pass, args) -> tuple[dict, dict]:
    """``args`` named: the tensors to tile, then the values passed whole."""
    n = len(keys_to_shard)
    return dict(zip(keys_to_shard, args[:n])), dict(zip(keys_to_pass, args[n:]))


def check_tiling(seqlen, keys_to_shard, keys_to_pass, key, dim, reduction, args) -> None:
    """`SequenceTiledCompute`'s arguments other than ``fn``, ``shards`` and ``compute_params``, checked (errors name
    the argument)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"SequenceTiledCompute: unknown output_reduction {reduction!r}: valid values are None, "
                         f'"mean" and "sum"')
    for name, value in (("seqlen", seqlen), ("output_unshard_dimension", dim)):
        if isinstance(value, bool):
            raise TypeError(f"SequenceTiledCompute: {name} must be an int, got {value!r}")
        try:
            operator.index(value)
        except TypeError:
            raise TypeError(f"SequenceTiledCompute: {name} must be an int, got {type(value).__name__}") from None
    if operator.index(seqlen) < 0:
        raise ValueError(f"SequenceTiledCompute: seqlen must be >= 0, got {seqlen}")
    if len(args) != len(keys_to_shard) + len(keys_to_pass):
        raise ValueError(f"SequenceTiledCompute: {len(keys_to_shard)} keys_to_shard and {len(keys_to_pass)} "
                         f"keys_to_pass need as many args, got {len(args)}")
    if key not in keys_to_shard:
        raise ValueError(f"SequenceTiledCompute: grad_requiring_tensor_key {key!r} must be one of keys_to_shard "
                         f"{keys_to_shard}")
    for k, v in zip(keys_to_shard, args):
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"SequenceTiledCompute: kwargs_to_shard[{k!r}] must be a tensor, got {type(v).__name__}")
        if v.dim() < 2 or v.shape[1] != operator.index(seqlen):
            raise ValueError(f"SequenceTiledCompute: kwargs_to_shard[{k!r}] must be [batch, seqlen={seqlen}, ...], "
                             f"got shape {tuple(v.shape)}")
