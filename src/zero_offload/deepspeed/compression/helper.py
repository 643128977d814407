"""``deepspeed.compression.helper``: its module-path helpers (DeepSpeed-Chat imports them for LoRA); the
compression functions are not built."""
from zero_offload.compat.unbuilt import INSTEAD, unbuilt_module_getattr
from zero_offload.deepspeed.utils import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
__getattr__ = unbuilt_module_getattr("deepspeed.compression.helper", INSTEAD["compression"])
