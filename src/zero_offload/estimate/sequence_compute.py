"""The device work a sequence adds to the step model's ``k x N x t`` FLOPs (`zero_offload.estimate.throughput`):
attention's, which grows with the sequence; the forward that sequence-tiled compute runs again in backward; and
Ulysses' all-to-alls.

- **Attention**: causal attention over ``s`` positions costs ``2 x L x q x s`` FLOPs per token in forward (``QK^T``
  and ``PV``, ``2 x q x s`` each over half the ``s x s`` scores) and twice that in backward: ``6 x L x q x s``, the
  causal half of PaLM's ``12 x L x h x s`` (Chowdhery et al. 2022, App. B). The step model counts it as
  ``L x q x s`` more parameters (`attention_params`), so the recompute of checkpointing (k = 8) repeats its forward
  as it does the rest. Under Ulysses each rank computes ``a / P`` heads over all ``s`` positions for its ``s / P``
  tokens: per local token the same ``6 x L x q x s``.
- **Tiled compute's recompute**: `TiledMLP` and `TiledFusedLogitsLoss` run each tile's forward again in backward
  (`tiled_recompute_params`): ``2 x t`` FLOPs per parameter of each MLP, and of the head.
- **Ulysses**: each block exchanges q, k and v before attention and its output after it, ``d x t x (2q + 2kv) x
  (P - 1) / P`` bytes per rank each way, in forward, in backward and in the recompute's forward, at
  ``interconnect`` bytes/s (`ulysses_seconds`); attention waits for them, so they add to the compute.
"""
from __future__ import annotations

from zero_offload.estimate.decoder_activations import SequenceTiles
from zero_offload.estimate.shape import ModelShape

__all__ = ["attention_params", "tiled_recompute_params", "ulysses_seconds"]


def _layers_width(shape: ModelShape) -> tuple[int, int, int]:
    """(layers, q width, k/v width) of a decoder or GPT shape; (0, 0, 0) for a bare count."""
    if shape.decoder is not None:
        m = shape.decoder
        return m.layers, m.heads * m.head_dim, m.kv_heads * m.head_dim
    if shape.gpt is not None:
        return shape.gpt.n_layer, shape.gpt.n_embd, shape.gpt.n_embd
    return 0, 0, 0


def attention_params(shape: ModelShape, seq_len: int) -> int:
    """``L x q x s``: causal attention's FLOPs per token over 6, as a parameter count (module docstring)."""
    layers, q, _ = _layers_width(shape)
    return layers * q * seq_len


def tiled_recompute_params(shape: ModelShape, tiles: SequenceTiles | None) -> int:
    """Parameters whose forward tiled compute runs once more in backward: each gated MLP's ``3 x h x I`` with
    `TiledMLP`, the head's ``V x h`` with `TiledFusedLogitsLoss` (a norm's is too small to count)."""
    m = shape.decoder
    if m is None or tiles is None:
        return 0
    return (m.layers * 3 * m.hidden * m.intermediate if tiles.mlp else 0) + (m.vocab * m.hidden if tiles.loss else 0)


def ulysses_seconds(shape: ModelShape, tokens: int, sequence_parallel: int, dtype_bytes: int, checkpointing: bool,
                    interconnect: float) -> float:
    """Seconds of one micro-step's all-to-alls under Ulysses of size ``sequence_parallel`` for ``tokens`` local
    tokens (0 at size 1): three passes (forward, backward, and the recompute's forward with checkpointing, else
    two) of ``d x t x (2q + 2kv) x (P - 1) / P`` bytes per block at ``interconnect`` bytes/s."""
    p = sequence_parallel
    if p <= 1:
        return 0.0
    layers, q, kv = _layers_width(shape)
    moved = dtype_bytes * tokens * (2 * q + 2 * kv) * (p - 1) / p
    return (3 if checkpointing else 2) * layers * moved / interconnect
