"""``deepspeed.checkpoint``: DeepSpeed's checkpoint key names (`constants`) and `utils`. Reading and writing
DeepSpeed's checkpoints is the engine's (``engine.load_checkpoint``, ``save_checkpoint(format=...)``)."""
from zero_offload.deepspeed.checkpoint import utils
from zero_offload.deepspeed.checkpoint.constants import *  # noqa: F401,F403
from zero_offload.deepspeed.checkpoint.constants import __all__ as _constants

__all__ = ["utils", *_constants]
