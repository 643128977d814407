"""`TiledFusedLogitsLoss`: a language model's logits and loss computed a tile of tokens at a time, so the whole
``[batch, seqlen, vocab]`` logits never exist (DeepSpeed 0.19.8's
``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledFusedLogitsLoss``; ALST, arXiv 2506.13996).

At long sequences the logits are the largest activation of a step: 32K tokens of a 128K vocabulary are 8 GiB in
bf16, and twice that once the loss upcasts them to fp32. Forward keeps one loss value per tile; backward recomputes
each tile's logits and loss and takes their gradient, so at most one tile's logits (and their gradient) exist.
"""
from __future__ import annotations

import torch

from zero_offload.tiling.tiles import (GradSums, agree_tile_count, candidate_params, check_shards, leaf_tile,
                                       needs_agreement, tile_bounds)

__all__ = ["TiledFusedLogitsLoss"]

REDUCTIONS = ("mean", "sum")


def check_loss_inputs(x, y, mask, output_reduction) -> None:
    """DeepSpeed 0.19.8's checks of `TiledFusedLogitsLoss`'s tensors, as ValueErrors naming the argument."""
    if output_reduction not in REDUCTIONS:
        raise ValueError(f'TiledFusedLogitsLoss: unknown output_reduction {output_reduction!r}: valid values are '
                         f'"mean" and "sum"')
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"TiledFusedLogitsLoss: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"TiledFusedLogitsLoss: {name} must be at least 2D [batch_size, seq_len, ...], got "
                             f"shape {tuple(t.shape)}")
    if x.shape[:2] != y.shape[:2]:
        raise ValueError(f"TiledFusedLogitsLoss: x and y must match in their batch and sequence dimensions, got "
                         f"{tuple(x.shape[:2])} and {tuple(y.shape[:2])}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError(f"TiledFusedLogitsLoss: mask must be 2D [batch_size, seq_len], got "
                             f"{getattr(mask, 'shape', type(mask).__name__)}")
        if mask.shape != x.shape[:2]:
            raise ValueError(f"TiledFusedLogitsLoss: mask shape {tuple(mask.shape)} must match x and y's batch and "
                             f"sequence dimensions {tuple(x.shape[:2])}")


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)``: the loss
    ``fn(self, x_tile, y_tile[, mask_tile])`` over ``shards`` tiles of tokens, reduced over the tiles, with DeepSpeed
    0.19.8's arguments and result.

    Args:
        fn: ``fn(self, x_tile, y_tile) -> loss`` (``mask_tile`` appended when ``mask`` is given): ``x_tile`` is
            ``[tokens, *x.shape[2:]]``, ``y_tile`` ``[tokens, *y.shape[2:]]`` (batch and sequence flattened), the
            loss a scalar (e.g. ``lm_head`` then cross entropy over the tile).
        self: passed to ``fn``: the module holding ``lm_head`` (often the model); its parameters may get gradients.
        x: ``[batch, seqlen, hidden]`` hidden states, any float dtype; kept for backward.
        y: ``[batch, seqlen, ...]`` targets (``shift_labels``).
        mask: None, or ``[batch, seqlen]``, tiled with ``x`` and ``y`` and passed to ``fn``.
        shards: the number of tiles, an int >= 1: tiles of ``ceil(batch * seqlen / shards)`` tokens (``torch.chunk``'s
            cut, which may give fewer tiles). Under ZeRO stage 3 on several ranks every rank uses the largest count
            any rank asks for, and runs ``fn`` on empty tiles to match the others' module calls (their results are
            left out).
        compute_params: the parameters ``fn`` uses, or None (see `TiledMLP`: each gradient arrives once).
        output_reduction: ``"mean"``: the mean of the tiles' losses (a mean of per-tile means: with uneven tiles or a
            mask, not the mean over tokens; DeepSpeed advises ``"sum"`` and dividing by the token count yourself), or
            ``"sum"``.

    Returns:
        The reduced loss: a 0-d tensor in ``fn``'s dtype.

    Raises:
        ValueError: ``output_reduction`` not ``"mean"``/``"sum"``; ``x`` or ``y`` under 2D; their batch and
            sequence dimensions differ; ``mask`` not 2D or not of that shape; ``shards`` < 1 (each names it).
        TypeError: ``fn`` not callable, ``shards`` not an int, ``compute_params`` not a list of tensors.
        SharedGradientError: see `TiledMLP`.

    Where DeepSpeed differs: it runs each tile's backward inside forward (assuming an incoming gradient of 1) and
    keeps ``x``'s gradient, so forward runs once; it then scales only ``x``'s gradient by the incoming one, not the
    parameters'. Here backward recomputes each tile (one more forward of ``lm_head`` per step), so a loss scale, a
    division by the accumulation steps or any use of the loss scales every gradient, and ZeRO's gradient hooks fire
    in backward, where the engine expects them. The mean's gradient divides by the tiles that ran, as the value does
    (DeepSpeed divides by ``shards`` even where ``torch.chunk`` gave fewer tiles).
    """

    @classmethod
    def apply(cls, fn, self, x, y, mask, shards, compute_params, output_reduction="mean"):
        if not callable(fn):
            raise TypeError(f"TiledFusedLogitsLoss: fn must be callable, got {type(fn).__name__}")
        check_loss_inputs(x, y, mask, output_reduction)
        shards = check_shards(shards)
        candidates = candidate_params(self, compute_params)
        agree = needs_agreement(candidates.every)
        if agree:
            shards = agree_tile_count(shards)
        return super().apply(fn, self, x, y, mask, shards, compute_params, output_reduction, agree, candidates.specs,
                             *candidates.inputs)

    @staticmethod
    def forward(ctx, fn, self, x, y, mask, shards, compute_params, output_reduction, agree, specs, *params):
        ctx.fn, ctx.module, ctx.agree, ctx.specs, ctx.params = fn, self, agree, specs, params
        ctx.save_for_backward(x, y, mask)
        xs, ys, ms = flat_tokens(x, y, mask)
        ctx.bounds = tile_bounds(xs.shape[0], shards)
        losses = []
        for lo, hi in ctx.bounds:
            if lo == hi and (losses or xs.shape[0]):
                if agree:                 # the same module calls as the other ranks; not counted
                    fn(self, *tile_args(xs, ys, ms, lo, hi))
                continue
            losses.append(fn(self, *tile_args(xs, ys, ms, lo, hi)))
        stacked = torch.cat([loss.unsqueeze(0) for loss in losses])
        ctx.factor = 1.0 / stacked.numel() if output_reduction == "mean" else 1.0
        return stacked.mean() if output_reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx, *grads):
        x, y, mask = ctx.saved_tensors
        fn, module = ctx.fn, ctx.module
        xs, ys, ms = flat_tokens(x.detach(), y, mask)
        wants_x = ctx.needs_input_grad[2]
        x_grad = torch.empty_like(xs) if wants_x else None
        grad_out = grads[0] * ctx.factor
        sums = GradSums(list(ctx.params), ctx.specs)
        run_empty = xs.shape[0] == 0
        for lo, hi in ctx.bounds:
            if lo == hi and not run_empty:
                if ctx.agree:
                    with torch.no_grad():
                        fn(module, *tile_args(xs, ys, ms, lo, hi))
                continue
            run_empty = False
            x_tile = leaf_tile(xs, lo, hi, 0, wants_x)
            rest = tile_args(xs, ys, ms, lo, hi)[1:]
            g = sums.tile(lambda: fn(module, x_tile, *rest), x_tile if wants_x else None, grad_out)
            if wants_x:
                x_grad[lo:hi] = g
        param_grads = sums.finish()
        x_grad = x_grad.view(x.shape) if wants_x else None
        return (None, None, x_grad, None, None, None, None, None, None, None, *param_grads)


def flat_tokens(x, y, mask):
    """``x``, ``y`` and ``mask`` with batch and sequence flattened into one token dimension."""
    return (x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:]),
            None if mask is None else mask.reshape(-1))


def tile_args(xs, ys, ms, lo, hi) -> tuple:
    """``fn``'s tensors for tokens ``lo:hi``: ``(x, y)``, and the mask where there is one."""
    return (xs[lo:hi], ys[lo:hi]) if ms is None else (xs[lo:hi], ys[lo:hi], ms[lo:hi])
