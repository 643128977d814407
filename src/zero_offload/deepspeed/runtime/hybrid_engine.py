"""``deepspeed.runtime.hybrid_engine``: not built in zero-offload (DeepSpeed-Chat's hybrid engine). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError` saying what to use instead."""
from zero_offload.compat.unbuilt import unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.runtime.hybrid_engine", "build a frozen engine (deepspeed.initialize with no optimizer) for generation")
