"""``deepspeed.ops.lamb``: ``FusedLamb``."""
from zero_offload.compat.ops.lamb import FusedLamb

__all__ = ["FusedLamb"]
