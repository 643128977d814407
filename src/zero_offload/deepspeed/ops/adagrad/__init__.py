"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad``."""
from zero_offload.compat.ops.adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
