"""The model's whole ``state_dict()`` on rank 0, gathered one stage-3 unit at a time."""
from __future__ import annotations

import torch

from zero_offload.zero.stage3 import gathered_parameters

__all__ = ["gathered_state_dict"]


@torch.no_grad()
def gathered_state_dict(engine, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every ``engine.module.state_dict()`` name -> CPU tensor (``dtype`` for floating tensors, default: as
    trained, i.e. the 16-bit parameters), tied aliases sharing one tensor.

    A collective at stage 3: each unit is gathered, copied to the host and released before the next, so the
    device holds one unit beyond the shards (DeepSpeed's ``_zero3_consolidated_16bit_state_dict``). Every
    rank returns the full dict.
    """
    module = engine.module
    params = dict(module.named_parameters(remove_duplicate=True))
    host: dict[int, torch.Tensor] = {}

    def to_host(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return (t.to(dtype) if dtype is not None and t.is_floating_point() else t).to("cpu", copy=True)

    for unit in getattr(engine.zero, "units", []):
        with gathered_parameters(unit.params):
            for p in unit.params:
                host[id(p)] = to_host(p)
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in host:
            host[id(t)] = to_host(t)
        out[name] = host[id(t)]
    del params
    return out
