"""``deepspeed.accelerator``: ``get_accelerator()``, a CUDA or a CPU accelerator with DeepSpeed's method names."""
from zero_offload.deepspeed.accelerator.real_accelerator import (
    Accelerator, get_accelerator, is_current_accelerator_supported, set_accelerator)

__all__ = ["Accelerator", "get_accelerator", "set_accelerator", "is_current_accelerator_supported"]
