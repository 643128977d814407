"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` (the fused host kernel) and ``FusedAdam``."""
from zero_offload.compat.ops.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
