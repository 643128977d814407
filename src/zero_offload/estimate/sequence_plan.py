"""The planner's choice of Ulysses' sequence-parallel size and of sequence-tiled compute for a decoder at a given
sequence length (``zero-offload estimate --hf-config ... --seq-len S``).

Each size that divides the ranks, the heads and the sequence (`longest.sequence_parallel_sizes`) is planned with
and without tiled compute (`longest.tiles_for` at each rank's ``s / P`` tokens: `TiledFusedLogitsLoss`,
`TiledMLP`, `tile_rms_norms`), each by `zero_offload.estimate.plan` with every other knob free; the fastest that
fits wins (predicted tokens/s per rank, which counts attention, the tiles' recompute and the all-to-alls:
`zero_offload.estimate.sequence_compute`), the smaller size and no tiles on a tie. A config that sets
``sequence_parallel_size`` keeps it. ``plan.reasons["sequence"]`` says what was chosen and what the run must do
for it: the tiles are model code (`zero_offload.tiling`), not config keys.
"""
from __future__ import annotations

from zero_offload.config.io import raw_config
from zero_offload.estimate.longest import sequence_parallel_sizes, tiles_for
from zero_offload.estimate.memory import ModelShape, default_plan_config
from zero_offload.estimate.planner import Plan, plan

__all__ = ["plan_sequence"]

TIE = 0.01     # within this share of the best tokens/s, the simpler setting wins


def plan_sequence(shape: ModelShape, gpus: int, gpu_memory, host_memory, nvme=None, *, seq_len: int | None = None,
                  config=None, **plan_kw) -> Plan:
    """The fastest plan for a decoder ``shape`` at ``seq_len`` over Ulysses sizes and tiled compute (module
    docstring); for any other shape, without ``seq_len`` or without an accelerator, `plan` as it is. ``config`` and
    ``plan_kw`` go to `plan` unchanged.

    Raises:
        ValueError, ConfigError: as `plan` does.
    """
    def one(base, tiles=None, ckpt=None) -> Plan:
        kw = dict(plan_kw, activation_checkpointing=ckpt) if ckpt is not None else plan_kw
        return plan(shape, gpus, gpu_memory, host_memory, nvme, seq_len=seq_len, config=base, tiles=tiles, **kw)
    plain = one(config)
    if shape.decoder is None or not seq_len or not gpu_memory or plan_kw.get("tiles") is not None:
        return plain
    raw = dict(raw_config(config) if isinstance(config, str) else config or default_plan_config())
    sizes = [raw["sequence_parallel_size"]] if raw.get("sequence_parallel_size") else \
        [p for p in sequence_parallel_sizes(shape, gpus) if seq_len % p == 0]
    # The model's checkpointing, unless given, is tried on as well: like the tiles, it is the run's to turn on
    ckpts = [None] if plan_kw.get("activation_checkpointing") is not None or shape.decoder.activation_checkpointing \
        else [None, True]
    tried: list[tuple[float, tuple, Plan]] = []
    for p in sizes:
        base = {**raw, "sequence_parallel_size": p} if p > 1 else config
        for ckpt in ckpts:
            for tiled in (False, True):
                key = (p, ckpt is True, tiled)
                found = plain if key == (1, False, False) and not raw.get("sequence_parallel_size") else \
                    one(base, tiles_for(shape, seq_len // p) if tiled else None, ckpt)
                if found.fits and found.batch is not None and found.batch.timing is not None:
                    tried.append((found.batch.timing.tokens_per_s, key, found))
    if not tried:
        return plain
    best = max(speed for speed, *_ in tried)
    speed, (p, ckpt, tiled), chosen = min((t for t in tried if t[0] >= (1 - TIE) * best), key=lambda t: t[1])
    others = ", ".join(f"{_label(*key)} ~{s:,.0f}" for s, key, _ in tried if key != (p, ckpt, tiled))
    what = _label(p, ckpt, tiled)
    if tiled:
        tiles = tiles_for(shape, seq_len // p)
        what += (f" (the logits and loss in {tiles.loss} tiles, each MLP in {tiles.mlp}, each RMSNorm in "
                 f"{tiles.norms}: the run must use TiledFusedLogitsLoss, tile_gated_mlps and tile_rms_norms, "
                 f"zero_offload.tiling)")
    if ckpt:
        what += "; the run must turn the model's activation checkpointing on (gradient_checkpointing_enable)"
    chosen.reasons["sequence"] = f"{what}: the fastest that fits (~{speed:,.0f} tokens/s per rank" + (
        f"; tried {others} tokens/s per rank)" if others else ")")
    return chosen


def _label(p: int, ckpt: bool, tiled: bool) -> str:
    return ", ".join([f"Ulysses sequence_parallel_size {p}" if p > 1 else "no Ulysses"]
                     + (["checkpointing"] if ckpt else []) + (["tiled"] if tiled else []))
