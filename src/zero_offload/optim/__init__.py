"""Host optimizer kernel, its torch.optim face, and DeepSpeed's LR schedules."""
from zero_offload.optim.cpu_adam import CPUAdam
from zero_offload.optim.fused_adam import fused_adam_step

__all__ = ["CPUAdam", "fused_adam_step"]
