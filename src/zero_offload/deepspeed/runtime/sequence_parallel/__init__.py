"""``deepspeed.runtime.sequence_parallel``: not built in zero-offload (sequence), except `ulysses_sp`'s sequence-tiled
compute. Every other name imports; using one raises `zero_offload.compat.unbuilt.NotBuiltError`, which says what to
use instead."""
from zero_offload.compat.unbuilt import INSTEAD, unbuilt_module_getattr
from zero_offload.deepspeed.runtime.sequence_parallel import ulysses_sp   # a module, not an unbuilt stand-in

__all__ = ["ulysses_sp"]

__getattr__ = unbuilt_module_getattr("deepspeed.runtime.sequence_parallel", INSTEAD["sequence"])
