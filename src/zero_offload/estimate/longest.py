"""The longest sequence a model trains at on one machine (``zero-offload estimate --longest``).

A binary search over the sequence length, in steps of `STEP` tokens up to `MAX_TOKENS`, finds the longest at which
any plan fits (`zero_offload.estimate.plan`, untimed, at micro-batch 1, accumulation 1, activation checkpointing on,
block inputs in host memory where that helps: the least device memory a step takes). Host memory is counted as the
device is: the optimizer states, the pinned buffers and the checkpoint inputs moved there. The longest is then
planned again with every knob but the sequence free, for its config and predicted tokens/s.

With more than one rank, each Ulysses sequence-parallel size that divides the ranks and the heads is tried
(`zero_offload.estimate.sequence_activations`: each rank holds ``s / P`` positions); the longest wins, the smaller
size on a tie.

A decoder's logits and loss, each block's MLP and each RMSNorm are counted in tiles (``tiled``, default on:
`TiledFusedLogitsLoss`, `TiledMLP` and `tile_rms_norms`, which the run must use, as ALST's recipe does with its
tiled loss, tiled MLP and Liger's RMSNorm), as many as keep one loss tile's head under `TILE_BYTES` and one MLP or
norm tile's work under it too; without them the ``12 * b*s/P*V`` bytes of the head and the MLP's ``4d * b*s/P*I``
bound the length. Then the bound is what every block keeps: its input (on the device or, with
``cpu_checkpointing``, in host memory, or split between them: `checkpoint_modes.split_inputs`) and one block's
recompute.

The predicted speed counts attention's FLOPs, which grow with the sequence, the tiles' recompute and Ulysses'
all-to-alls (`zero_offload.estimate.sequence_compute`); the line says how much attention adds where it is more than a
tenth of the 6N FLOPs per token (`ATTENTION_SHARE_NOTED`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zero_offload.config.io import raw_config
from zero_offload.estimate.decoder_activations import SequenceTiles
from zero_offload.estimate.memory import ModelShape, default_plan_config
from zero_offload.estimate.planner import Plan, plan

__all__ = ["Longest", "longest", "tiles_for", "sequence_parallel_sizes", "STEP", "MAX_TOKENS", "TILE_BYTES",
           "ATTENTION_SHARE_NOTED"]

STEP = 1024                 # the sequence lengths tried are multiples of this
MAX_TOKENS = 1 << 24        # 16M tokens: beyond what any single machine holds
TILE_BYTES = 1 << 30        # one loss tile's fp32 logits and gradients, one MLP tile's intermediates: at most 1 GiB
ATTENTION_SHARE_NOTED = 0.1  # from here the line says how much attention adds to the 6N FLOPs per token


@dataclass
class Longest:
    """The answer: ``seq_len`` (tokens), ``plan``, the plan at that length with every other knob free, and the
    Ulysses ``sequence_parallel`` size it needs (1: none)."""
    seq_len: int
    plan: Plan
    sequence_parallel: int = 1
    tiles: SequenceTiles | None = None

    attention_share: float = 0.0     # attention's s-proportional FLOPs per token over the 6N the step model counts

    def lines(self) -> list[str]:
        t = self.plan.batch.timing if self.plan.batch is not None else None
        speed = f", ~{t.tokens_per_s:,.0f} tokens/s per rank predicted" if t is not None else ""
        if t is not None and self.attention_share > ATTENTION_SHARE_NOTED:
            speed += f", attention {self.attention_share:.1f}x the 6N FLOPs per token"
        if self.sequence_parallel > 1:
            local = self.seq_len // self.sequence_parallel
            speed += f"; Ulysses sequence_parallel_size {self.sequence_parallel}: {local:,} tokens per rank"
        tiles = (f"; the logits and loss in {self.tiles.loss} tiles, each MLP in {self.tiles.mlp}, each RMSNorm in "
                 f"{self.tiles.norms} (TiledFusedLogitsLoss, TiledMLP and tile_rms_norms, which the run must use)"
                 if self.tiles else "")
        kept = ((self.plan.config or {}).get("activation_checkpointing") or {}).get("cpu_checkpointing_device_inputs")
        if kept:
            tiles += f"; block inputs: the first {kept} on the device, the rest in host memory"
        return [f"longest sequence that trains: {self.seq_len:,} tokens ({self.plan.name}{speed}{tiles})",
                self.plan.message()]


def tiles_for(shape: ModelShape, tokens: int, dtype_bytes: int = 2) -> SequenceTiles | None:
    """Tiles that keep one loss tile's head (``12 * c * V`` bytes), one MLP tile's recompute and gradients
    (``6d * c * I``) and one RMSNorm tile's fp32 work in backward (``24 * c * h``) under `TILE_BYTES`; None for a
    GPT shape (its compute is not tiled in the memory model)."""
    m = shape.decoder
    if m is None:
        return None
    return SequenceTiles(loss=max(1, -(-12 * tokens * m.vocab // TILE_BYTES)),
                         mlp=max(1, -(-6 * dtype_bytes * tokens * m.intermediate // TILE_BYTES)),
                         norms=max(1, -(-24 * tokens * m.hidden // TILE_BYTES)))


def sequence_parallel_sizes(shape: ModelShape, gpus: int) -> list[int]:
    """The Ulysses sizes ``shape`` can run at on ``gpus`` ranks: divisors of ``gpus`` that divide the query heads
    and divide, or are divided by, the key/value heads."""
    heads, kv = ((shape.decoder.heads, shape.decoder.kv_heads) if shape.decoder is not None else
                 (shape.gpt.n_head, shape.gpt.n_head) if shape.gpt is not None else (1, 1))
    return [p for p in range(1, gpus + 1) if gpus % p == 0 and heads % p == 0 and (kv % p == 0 or p % kv == 0)]


def longest(shape: ModelShape, gpus: int, gpu_memory, host_memory, nvme=None, *, config=None,
            sequence_parallel: int | None = None, tiled: bool = True, **plan_kw) -> Longest | None:
    """The longest sequence ``shape`` trains at on ``gpus`` ranks with this memory (module docstring), over the
    Ulysses sizes `sequence_parallel_sizes` allows (or the one given), or None when not even `STEP` tokens fit.
    ``config`` and ``plan_kw`` (allowances, rates, calibration) go to `plan` as they are.

    Raises:
        ValueError: as `plan` does (a bad size or count).
    """
    best = None
    for p in [sequence_parallel] if sequence_parallel else sequence_parallel_sizes(shape, gpus):
        base = config
        if p > 1:
            base = dict(raw_config(config) if isinstance(config, str) else config or default_plan_config())
            base["sequence_parallel_size"] = p
        step = STEP if STEP % p == 0 else STEP * p       # lengths the size divides
        found = _longest_at(shape, gpus, gpu_memory, host_memory, nvme, base, step, p, tiled, plan_kw)
        if found is not None and (best is None or found.seq_len > best.seq_len):
            best = dataclasses.replace(found, sequence_parallel=p)
    if best is not None:
        best.attention_share = attention_share(shape, best.seq_len)
    return best


def attention_share(shape: ModelShape, seq_len: int) -> float:
    """Causal attention's FLOPs per token, 6 * L * q * s (forward and backward, half the s x s scores), over the
    6 * N of the rest (`zero_offload.estimate.sequence_compute`)."""
    if shape.decoder is not None:
        layers, width = shape.decoder.layers, shape.decoder.heads * shape.decoder.head_dim
    elif shape.gpt is not None:
        layers, width = shape.gpt.n_layer, shape.gpt.n_embd
    else:
        return 0.0
    return layers * width * seq_len / max(1, shape.n_params)


def _longest_at(shape, gpus, gpu_memory, host_memory, nvme, config, step, p, tiled, plan_kw) -> Longest | None:
    """The longest multiple of ``step`` tokens that fits with ``config`` (None: not even ``step``)."""
    def tiles(seq: int) -> SequenceTiles | None:
        return tiles_for(shape, seq // p) if tiled else None

    def fits(seq: int) -> bool:
        return plan(shape, gpus, gpu_memory, host_memory, nvme, micro_batch=1, gradient_accumulation=1,
                    seq_len=seq, activation_checkpointing=True, config=config, timed=False, tiles=tiles(seq),
                    **plan_kw).fits

    if not fits(step):
        return None
    lo, hi = step, 2 * step                    # lo fits; find an hi that does not, doubling
    while hi <= MAX_TOKENS and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, MAX_TOKENS + step)
    while hi - lo > step:                      # lo fits, hi does not
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return Longest(lo, plan(shape, gpus, gpu_memory, host_memory, nvme, seq_len=lo, config=config,
                            activation_checkpointing=True, tiles=tiles(lo), **plan_kw), tiles=tiles(lo))
