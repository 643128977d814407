"""``deepspeed.runtime.base_optimizer``: DeepSpeed's optimizer base classes, for ``isinstance`` checks: the
optimizer ``deepspeed.initialize`` returns is a ``ZeROOptimizer`` (`zero_offload.compat.optimizer_face`)."""
from zero_offload.compat.optimizer_face import DeepSpeedOptimizer, ZeROOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
