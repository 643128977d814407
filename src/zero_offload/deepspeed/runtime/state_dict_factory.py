"""``deepspeed.runtime.state_dict_factory``: not built in zero-offload (Megatron's tensor-parallel checkpoint loader). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError` saying what to use instead."""
from zero_offload.compat.unbuilt import unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.runtime.state_dict_factory", "load a zero-offload, DeepSpeed or DCP checkpoint with engine.load_checkpoint")
