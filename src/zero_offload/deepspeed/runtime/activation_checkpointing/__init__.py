"""``deepspeed.runtime.activation_checkpointing``."""
from zero_offload.deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
