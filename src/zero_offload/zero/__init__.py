"""ZeRO stages 0-2: partitioned optimizer states and gradients across data-parallel ranks."""
from zero_offload.zero.zero_optimizer import ParamGroup, ZeroOptimizer

__all__ = ["ParamGroup", "ZeroOptimizer"]
