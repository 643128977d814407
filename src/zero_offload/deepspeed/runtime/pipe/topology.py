"""``deepspeed.runtime.pipe.topology``: not built in zero-offload (pipeline). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError`, which says what to use instead."""
from zero_offload.compat.unbuilt import INSTEAD, unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.runtime.pipe.topology", INSTEAD["pipeline"])
