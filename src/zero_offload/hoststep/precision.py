"""bf16 master weights in a partition optimizer (DeepSpeed 0.19.8's ``bf16_master_weights_and_grads``,
``ZeROOptimizer._configure_master_weights``): their rounding from the config, and what they need. The dtypes
themselves are the config's (`zero_offload.config.BF16Config.master_dtype`, ``state_dtype``)."""
from __future__ import annotations

import torch

__all__ = ["master_rounding", "check_bf16_masters"]


def master_rounding(config) -> dict:
    """`PartitionedAdam`'s rounding arguments: ``bf16.master_weights_rounding`` and the run's seed (``seed``, 0
    when unset) as stochastic rounding's key."""
    return {"rounding": config.bf16.master_weights_rounding, "seed": config.seed or 0}


def check_bf16_masters(parts: list[torch.Tensor], on_host: bool, dtype: torch.dtype) -> None:
    """bf16 masters are stepped by the fused host kernel over bf16 parts.

    Raises:
        ValueError: parts that are not bf16, or the states on an accelerator (names the config keys).
    """
    if dtype != torch.bfloat16 or any(p.dtype != torch.bfloat16 for p in parts):
        raise ValueError(f"bf16 master weights need bf16 parameters ('bf16.enabled' = true); master dtype {dtype}, "
                         f"parameters {sorted({str(p.dtype) for p in parts})}")
    if not on_host:
        raise ValueError("bf16 master weights (config key 'bf16.bf16_master_weights_and_grads') need the optimizer "
                         "states on the host: set 'zero_optimization.offload_optimizer.device' = 'cpu' (the device "
                         "Adam over bf16 masters is not built)")
