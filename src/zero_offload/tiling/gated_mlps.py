"""Every Llama-style MLP of a model (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``: Llama, Qwen2, Mistral)
computed in tiles of the sequence with `TiledMLP`, as ALST's recipe patches ``LlamaMLP.forward`` (arXiv 2506.13996)."""
from __future__ import annotations

import torch

from zero_offload.tiling.tiled_mlp import TiledMLP

__all__ = ["tile_gated_mlps"]


def _gated(module, x):
    return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))


def _tiled_forward(tiles: int):
    def forward(self, x):
        return TiledMLP.apply(_gated, self, x, tiles, [self.gate_proj.weight, self.up_proj.weight,
                                                      self.down_proj.weight])
    return forward


def tile_gated_mlps(model: torch.nn.Module, tiles: int) -> int:
    """Give every gated MLP of ``model`` a forward in ``tiles`` tiles (in place); returns how many were patched."""
    patched = 0
    for m in model.modules():
        if all(hasattr(m, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            m.forward = _tiled_forward(tiles).__get__(m)
            patched += 1
    return patched
