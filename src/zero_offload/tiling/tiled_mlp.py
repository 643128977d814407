"""`TiledMLP`: a per-token function (a transformer's MLP) computed a tile of tokens at a time, forward and backward
(DeepSpeed 0.19.8's ``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP``; ALST, arXiv 2506.13996).

An MLP's intermediate activations are ``intermediate_size / hidden_size`` (3.5 for Llama-3-8B) times its input,
and autograd keeps them for backward; tiled, only one tile's exist at a time, and backward recomputes each tile's
forward before its backward: one more forward of the MLP per step.
"""
from __future__ import annotations

import torch

from zero_offload.tiling.tiles import (GradSums, agree_tile_count, candidate_params, check_shards, leaf_tile,
                                       needs_agreement, tile_bounds)

__all__ = ["TiledMLP"]


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, self, x, shards, compute_params)``: ``fn(self, x)`` computed ``shards`` tiles of
    tokens at a time, with DeepSpeed 0.19.8's arguments and result.

    Args:
        fn: ``fn(self, x_tile) -> y_tile``, per token: ``x_tile`` is ``[tokens, hidden]`` (the leading dimensions
            of ``x`` flattened; DeepSpeed's backward passes the same), ``y_tile`` is ``[tokens, *out]``.
        self: the MLP module, passed to ``fn``; its parameters get gradients (under ZeRO stage 3 call this from
            inside its ``forward``, so the module's own parameters are gathered, as DeepSpeed's example does).
        x: ``[batch, seqlen, hidden]`` or ``[seqlen, hidden]`` (a mixture-of-experts layer's tokens), any float
            dtype; it is kept for backward, as autograd would keep it for the MLP.
        shards: the number of tiles, an int >= 1: tiles of ``ceil(tokens / shards)`` tokens (``torch.chunk``'s
            cut). Under ZeRO stage 3 on several ranks every rank uses the largest count any rank asks for (one
            small all-gather; DeepSpeed's example does it with an all-reduce of the max before calling): each tile
            runs the MLP's submodules, and each of their stage-3 gathers is a collective.
        compute_params: the parameters ``fn`` uses, or None. DeepSpeed needs them to hold back its ZeRO reduction
            until the last tile. Here each one whose values are present at the call is an input of the autograd
            node: its gradient, summed over the tiles, joins autograd's accumulation with the rest of the graph's
            (a tied weight gets one gradient); one ``fn`` does not use gets zeros (DeepSpeed: None). Any other
            parameter ``fn`` reaches (``self``'s unlisted ones, a stage-3 parameter not gathered at the call) gets
            its sum by one backward of its own at the end. Either way each gradient reaches ``.grad`` (and ZeRO's
            hooks) once per backward, not once per tile.

    Returns:
        ``[*x.shape[:-1], *out]``, ``fn``'s dtype: the tiles' results in order (equal to ``fn(self, x)`` up to the
        rounding of the smaller matrix products).

    Raises:
        TypeError: ``fn`` not callable, ``x`` not a tensor, ``shards`` not an int, ``compute_params`` not a list of
            tensors (each names the argument).
        ValueError: ``shards`` < 1; ``x`` with fewer than 2 dimensions.
        SharedGradientError: in backward, a parameter outside the node's inputs that the rest of the graph also
            feeds (a tied weight not in ``compute_params``, or partitioned by stage 3 at the call); see `watch`.

    Backward recomputes each tile under grad and takes ``torch.autograd.grad`` of it; 16-bit parameter gradients
    are summed in fp32 (a buffer the size of the parameters, during this backward) and rounded once. DeepSpeed
    accumulates into ``.grad`` tile by tile in the parameter's dtype.
    """

    @classmethod
    def apply(cls, fn, self, x, shards, compute_params=None):
        if not callable(fn):
            raise TypeError(f"TiledMLP: fn must be callable, got {type(fn).__name__}")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"TiledMLP: x must be a tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be [batch, seqlen, hidden] or [seqlen, hidden], got shape "
                             f"{tuple(x.shape)}")
        shards = check_shards(shards)
        candidates = candidate_params(self, compute_params)
        agree = needs_agreement(candidates.every)
        if agree:
            shards = agree_tile_count(shards)
        return super().apply(fn, self, x, shards, compute_params, agree, candidates.specs, *candidates.inputs)

    @staticmethod
    def forward(ctx, fn, self, x, shards, compute_params, agree, specs, *params):
        ctx.fn, ctx.module, ctx.agree, ctx.specs, ctx.params = fn, self, agree, specs, params
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])
        ctx.bounds = tile_bounds(rows.shape[0], shards)
        out = None
        for lo, hi in ctx.bounds:
            if lo == hi and out is not None and not agree:
                continue                  # torch.chunk has no such tile; agreed ranks all run every one
            y = fn(self, rows[lo:hi])
            if out is None:
                out = y.new_empty((rows.shape[0], *y.shape[1:]))
            out[lo:hi] = y
        return out.view(*x.shape[:-1], *out.shape[1:])

    @staticmethod
    def backward(ctx, *grads):
        (x,) = ctx.saved_tensors
        fn, module = ctx.fn, ctx.module
        rows = x.detach().reshape(-1, x.shape[-1])
        grad_rows = grads[0].reshape(rows.shape[0], -1)
        wants_x = ctx.needs_input_grad[2]
        x_grad = torch.empty_like(rows) if wants_x else None
        sums = GradSums(list(ctx.params), ctx.specs)
        for lo, hi in ctx.bounds:
            if lo == hi:
                if ctx.agree:             # the same module calls as the other ranks
                    with torch.no_grad():
                        fn(module, rows[lo:hi])
                continue
            x_tile = leaf_tile(rows, lo, hi, 0, wants_x)
            g = sums.tile(lambda: fn(module, x_tile), x_tile if wants_x else None, grad_rows[lo:hi])
            if wants_x:
                x_grad[lo:hi] = g.reshape(hi - lo, -1)
        param_grads = sums.finish()
        return (None, None, x_grad.view(x.shape) if wants_x else None, None, None, None, None, *param_grads)
