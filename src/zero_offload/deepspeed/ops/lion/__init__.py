"""``deepspeed.ops.lion``: ``DeepSpeedCPULion`` and ``FusedLion`` are not built (no Lion in torch.optim to run on the
partitions); give the config an Adam, AdamW, Lamb or torch.optim optimizer."""
from zero_offload.compat.unbuilt import unbuilt

__all__ = ["DeepSpeedCPULion", "FusedLion"]

_INSTEAD = "use AdamW (the fused host kernel) or any torch.optim optimizer"
DeepSpeedCPULion = unbuilt("deepspeed.ops.lion.DeepSpeedCPULion", _INSTEAD)
FusedLion = unbuilt("deepspeed.ops.lion.FusedLion", _INSTEAD)
