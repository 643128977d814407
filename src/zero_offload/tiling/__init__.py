"""Sequence-tiled compute: a transformer's MLP, and its logits with their loss, computed a tile of the sequence at a
time, so that their large activations (the MLP's intermediate, the ``[batch, seqlen, vocab]`` logits) exist for one
tile only (DeepSpeed 0.19.8's ``ulysses_sp.TiledMLP``, ``TiledFusedLogitsLoss`` and ``SequenceTiledCompute``; ALST,
arXiv 2506.13996). docs/long-sequences.md shows their use on a Hugging Face Llama.
"""
from zero_offload.tiling.gated_mlps import tile_gated_mlps
from zero_offload.tiling.rms_norms import tile_rms_norms
from zero_offload.tiling.sequence_tiled import SequenceTiledCompute, sequence_tiled_compute
from zero_offload.tiling.tiled_loss import TiledFusedLogitsLoss
from zero_offload.tiling.tiled_mlp import TiledMLP
from zero_offload.tiling.tiles import SharedGradientError, agree_tile_count

__all__ = ["TiledMLP", "TiledFusedLogitsLoss", "SequenceTiledCompute", "sequence_tiled_compute",
           "agree_tile_count", "SharedGradientError", "tile_gated_mlps", "tile_rms_norms"]
