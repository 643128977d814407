"""``deepspeed.module_inject.layers``: not built in zero-offload (tensor parallelism). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError` saying what to use instead."""
from zero_offload.compat.unbuilt import unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.module_inject.layers", "train data parallel with ZeRO stage 3")
