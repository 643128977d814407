"""A small Llama-shaped model whose MLPs and loss can run sequence-tiled (`zero_offload.tiling`), its plain-PyTorch
AdamW reference, and its runs under the engine on each rank (`dist_utils.run_ranks`), for tests/test_tiled_compute.py.

Block 0's MLP is Llama's (its weights in child ``nn.Linear`` modules, the function calls them, as DeepSpeed's Llama
example patches ``LlamaMLP``); block 1's holds its weights itself and reads them in the function (``F.linear``), so
under stage 3 it is gathered by its own module's forward around the tiled call. The loss tiles ``lm_head`` and cross
entropy with ``output_reduction="sum"`` divided by the token count: the untiled mean for any tiling.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zero_offload
from zero_offload.tiling import TiledFusedLogitsLoss, TiledMLP

VOCAB, HIDDEN, INTER, MICRO, LR, WD = 64, 16, 40, 2, 3e-3, 0.01


def gated_forward(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def direct_forward(self, x):
    return F.linear(F.gelu(F.linear(x, self.w_in, self.b_in)), self.w_out)


def loss_sum(self, x, y):
    return F.cross_entropy(self.lm_head(x).float(), y, reduction="sum")


class GatedMLP(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.act_fn = nn.SiLU()
        self.tiles = model.mlp_tiles

    def forward(self, x):
        shards = self.tiles(x)
        if shards is None:
            return gated_forward(self, x)
        return TiledMLP.apply(gated_forward, self, x, shards,
                              [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])


class DirectMLP(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(INTER, HIDDEN) / HIDDEN ** 0.5)
        self.b_in = nn.Parameter(torch.randn(INTER) * 0.1)
        self.w_out = nn.Parameter(torch.randn(HIDDEN, INTER) / INTER ** 0.5)
        self.tiles = model.mlp_tiles

    def forward(self, x):
        shards = self.tiles(x)
        if shards is None:
            return direct_forward(self, x)
        return TiledMLP.apply(direct_forward, self, x, shards, [self.w_in, self.b_in, self.w_out])


class Block(nn.Module):
    def __init__(self, mlp, reentrant: bool | None):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = mlp
        self.reentrant = reentrant

    def forward(self, x):
        if self.reentrant is None:
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=self.reentrant)

    def block(self, x):
        h = self.mix(self.norm(x)).cumsum(1)       # causal running mean over the sequence: tokens interact
        h = h / torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[:, None]
        x = x + h
        return x + self.mlp(x)


class TinyLlama(nn.Module):
    """``tiles``: None (untiled), an int (every tiled call uses that many tiles) or ``"per-length"`` (DeepSpeed's
    Llama example: ``ceil(seqlen / 4)`` tiles for an MLP and ``ceil(tokens / 4)`` for the loss, so ranks with
    other lengths ask for other counts). ``reentrant``: None, or each block under ``torch.utils.checkpoint`` with
    that ``use_reentrant``."""

    def __init__(self, tiles=None, reentrant: bool | None = None):
        super().__init__()
        self.tiles = tiles
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(GatedMLP(self), reentrant), Block(DirectMLP(self), reentrant)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def mlp_tiles(self, x):
        if self.tiles == "per-length":
            return math.ceil(x.shape[1] / 4)
        return self.tiles

    def forward(self, idx, targets):
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        if self.tiles is None:
            return F.cross_entropy(self.lm_head(h).view(-1, VOCAB), targets.reshape(-1))
        shards = math.ceil(targets.numel() / 4) if self.tiles == "per-length" else self.tiles
        total = TiledFusedLogitsLoss.apply(loss_sum, self, h, targets, None, shards, [self.lm_head.weight], "sum")
        return total / targets.numel()


def make_model(tiles=None, reentrant: bool | None = None, seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama(tiles, reentrant)


def batch(step: int, rank: int, length: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, VOCAB, (MICRO, length + 1), generator=g)
    return data[:, :-1], data[:, 1:]


@functools.lru_cache(maxsize=None)
def reference(lengths: tuple[int, ...], steps: int) -> tuple[dict, list[list[float]]]:
    """Plain ``torch.optim.AdamW`` on one process, untiled: each step's loss is the mean over the ranks' batches
    (each rank's own mean, as the engine averages the ranks' gradients). Returns the parameters and, per step,
    each rank's loss."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        per_rank = [model(*batch(step, r, n)) for r, n in enumerate(lengths)]
        torch.stack(per_rank).mean().backward()
        opt.step()
        losses.append([loss.item() for loss in per_rank])
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def config(stage: int) -> dict:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 500, "overlap_comm": True}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=100, stage3_prefetch_bucket_size=3000)
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, "zero_optimization": zero}


def engine_run(stage: int, tiles, lengths: list[int], steps: int, reentrant: bool | None = None) -> dict:
    """Train under the engine on this rank's batches (``reentrant``: see `TinyLlama`). Returns the gathered
    parameters, this rank's losses, the most and fewest times any parameter's gradient reached ``.grad`` in one
    backward, and the engine's gradient reductions per step (`engine.stats`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    engine = zero_offload.initialize(make_model(tiles, reentrant), config(stage))
    arrivals = {}
    for p in engine.module.parameters():
        p.register_post_accumulate_grad_hook(lambda q: arrivals.__setitem__(id(q), arrivals.get(id(q), 0) + 1))
    losses, most, fewest, reductions = [], 0, 1 << 30, []
    for step in range(steps):
        loss = engine(*batch(step, rank, lengths[rank]))
        arrivals.clear()
        engine.backward(loss)
        counts = [arrivals.get(id(p), 0) for p in engine.module.parameters()]
        most, fewest = max(most, *counts), min(fewest, *counts)
        engine.step()
        reductions.append(engine.stats.reductions)
        losses.append(loss.item())
    with zero_offload.gathered_parameters(engine.module.parameters()):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.close()
    return {"params": params, "losses": losses, "most": most, "fewest": fewest, "reductions": reductions}


def engine_runs(cases: list[tuple]) -> list[dict]:
    return [engine_run(*case) for case in cases]


class Conformance(nn.Module):
    """The module of DeepSpeed's docstring examples: Llama's MLP and an ``lm_head``."""

    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN)
        self.act_fn = nn.SiLU()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)


def loss_mean(self, x, y):
    return F.cross_entropy(self.lm_head(x).float(), y)


def loss_masked_sum(self, x, y, mask):
    return (F.cross_entropy(self.lm_head(x).float(), y, reduction="none") * mask).sum()


def conformance(impl) -> dict:
    """DeepSpeed's examples run through ``impl`` (DeepSpeed 0.19.8's ``ulysses_sp`` module or ``zero_offload.tiling``)
    on 2 x 13 tokens: {case: [result, x's gradient, each parameter's gradient]}. Cases whose name ends in "value"
    keep the result only (there DeepSpeed's gradient of a mean divides by ``shards`` where ``torch.chunk`` made
    fewer tiles: 26 tokens in 10 tiles of 3 are 9 tiles)."""
    torch.manual_seed(0)
    m = Conformance()
    x0, y = torch.randn(2, 13, HIDDEN), torch.randint(0, VOCAB, (2, 13))
    mask = (torch.rand(2, 13) > 0.3).float()
    params = list(m.parameters())

    def stc_loss(x, y):
        return F.cross_entropy(m.lm_head(x).reshape(-1, VOCAB), y.reshape(-1))

    def stc_mlp(x):
        return gated_forward(m, x)

    calls = {
        "mlp/1": lambda x: impl.TiledMLP.apply(gated_forward, m, x, 1, params[:-1]),
        "mlp/3": lambda x: impl.TiledMLP.apply(gated_forward, m, x, 3, params[:-1]),
        "mlp/5": lambda x: impl.TiledMLP.apply(gated_forward, m, x, 5, params[:-1]),
        "mlp-tokens/4": lambda x: impl.TiledMLP.apply(gated_forward, m, x.view(-1, HIDDEN), 4, params[:-1]),
        "loss-mean/3": lambda x: impl.TiledFusedLogitsLoss.apply(loss_mean, m, x, y, None, 3, params[-1:], "mean"),
        "loss-mean/5": lambda x: impl.TiledFusedLogitsLoss.apply(loss_mean, m, x, y, None, 5, params[-1:], "mean"),
        "loss-mask-sum/4": lambda x: impl.TiledFusedLogitsLoss.apply(loss_masked_sum, m, x, y, mask, 4, params[-1:],
                                                                      "sum"),
        "loss-mean/10/value": lambda x: impl.TiledFusedLogitsLoss.apply(loss_mean, m, x, y, None, 10, params[-1:],
                                                                         "mean"),
        "stc-loss/3": lambda x: impl.sequence_tiled_compute(stc_loss, 13, 3, {"x": x, "y": y}, {}, "x", params[-1:],
                                                            0, "mean"),
        "stc-loss/5": lambda x: impl.sequence_tiled_compute(stc_loss, 13, 5, {"x": x, "y": y}, {}, "x", params[-1:],
                                                            0, "sum"),
        "stc-mlp/3": lambda x: impl.sequence_tiled_compute(stc_mlp, 13, 3, {"x": x}, {}, "x", params[:-1], 1, None),
    }
    out = {}
    for name, call in calls.items():
        m.zero_grad()
        x = x0.clone().requires_grad_()
        result = call(x)
        if name.endswith("value"):
            out[name] = [result.detach()]
            continue
        result.backward(torch.full_like(result, 1.0 / result.numel()))
        out[name] = [result.detach(), x.grad] + [p.grad for p in params]
    return out
