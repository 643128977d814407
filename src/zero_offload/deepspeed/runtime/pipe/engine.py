"""``deepspeed.runtime.pipe.engine``: not built in zero-offload (pipeline parallelism). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError` saying what to use instead."""
from zero_offload.compat.unbuilt import unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.runtime.pipe.engine", "train data parallel with ZeRO stage 3 (and offload) instead")
