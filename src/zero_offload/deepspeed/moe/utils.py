"""``deepspeed.moe.utils``: not built in zero-offload (expert parallelism). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError` saying what to use instead."""
from zero_offload.compat.unbuilt import unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.moe.utils", "a mixture-of-experts model trains data parallel at stage 3 with set_z3_leaf_modules")
