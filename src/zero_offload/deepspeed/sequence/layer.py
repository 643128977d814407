"""``deepspeed.sequence.layer``: not built in zero-offload (sequence parallelism (Ulysses/FPDT) is not built yet). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError` saying what to use instead."""
from zero_offload.compat.unbuilt import unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.sequence.layer", "train long sequences with activation checkpointing")
