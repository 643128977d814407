"""``deepspeed.runtime.sequence_parallel``: `ulysses_sp` (Ulysses for Hugging Face models and the sequence-tiled
compute) and `parallel_state_sp` (its groups) are built. Every other name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError`, which says what to use instead."""
from zero_offload.compat.unbuilt import INSTEAD, unbuilt_module_getattr
from zero_offload.deepspeed.runtime.sequence_parallel import parallel_state_sp, ulysses_sp   # modules, not stand-ins

__all__ = ["ulysses_sp", "parallel_state_sp"]

__getattr__ = unbuilt_module_getattr("deepspeed.runtime.sequence_parallel", INSTEAD["sequence"])
