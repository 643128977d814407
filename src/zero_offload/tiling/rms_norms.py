"""Every RMSNorm of a model (Llama, Qwen2, Mistral: a ``*RMSNorm`` module with a ``weight``) computed in tiles of
tokens by `TiledMLP`, which keeps only its input for backward and recomputes each tile there.

Why: transformers' RMSNorm upcasts its input to fp32 and autograd keeps that copy (4 bytes per element in 16-bit
training), the reciprocal RMS and the normalised tensor besides the output: about 8h + 4 bytes per token and norm
more than the input and output a norm needs, two norms per block. At long sequences that is what a block's
recompute holds longest (Llama-3-8B, 600K tokens: 39 GB). Liger-Kernel's fused RMSNorm, which ALST's recipes use
(arXiv 2506.13996), keeps the input and the reciprocal RMS; here the norm's own forward runs per tile, so the
result is the model's own to the bit (a norm works token by token); the weight's gradient is summed over the tiles
in fp32 (`TiledMLP`), and the gradients within 1e-6 of the untiled model's in fp32 (tests/test_tiled_compute.py).
"""
from __future__ import annotations

import torch

from zero_offload.tiling.tiled_mlp import TiledMLP

__all__ = ["tile_rms_norms", "is_rms_norm"]


def is_rms_norm(module: torch.nn.Module) -> bool:
    """A transformers-style RMSNorm: its class name ends in ``RMSNorm`` and it has a ``weight`` parameter."""
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None),
                                                                     torch.nn.Parameter)


def _norm(module, x):
    return type(module).forward(module, x)


def _tiled_forward(tiles: int):
    def forward(self, x):
        if not torch.is_grad_enabled():
            return _norm(self, x)
        return TiledMLP.apply(_norm, self, x, tiles, [self.weight])
    return forward


def tile_rms_norms(model: torch.nn.Module, tiles: int) -> int:
    """Give every RMSNorm of ``model`` (`is_rms_norm`) a forward in ``tiles`` tiles of tokens that keeps only its
    input for backward (in place); returns how many were patched. ``tiles``: an int >= 1 (`TiledMLP`'s
    ``shards``; under ZeRO stage 3 agreed across ranks as it is there).

    Raises:
        TypeError, ValueError: ``tiles`` not an int >= 1 (checked here, before any module changes).
    """
    from zero_offload.tiling.tiles import check_shards
    check_shards(tiles, "tiles")
    patched = 0
    for m in model.modules():
        if is_rms_norm(m):
            m.forward = _tiled_forward(tiles).__get__(m)
            patched += 1
    return patched
