"""``deepspeed.inference.engine``: not built in zero-offload (DeepSpeed inference). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError` saying what to use instead."""
from zero_offload.compat.unbuilt import unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.inference.engine", "generate with transformers' generate() under engine.module (or vLLM)")
