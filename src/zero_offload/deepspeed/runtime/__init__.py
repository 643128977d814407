"""``deepspeed.runtime``: the engine, ZeRO, LR schedules, activation checkpointing and their helpers."""
from zero_offload.deepspeed.runtime import zero

__all__ = ["zero"]
