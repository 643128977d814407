"""``deepspeed.profiling``: not built in zero-offload (DeepSpeed's flops profiler). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError` saying what to use instead."""
from zero_offload.compat.unbuilt import unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.profiling", "use torch.profiler or zero-offload's engine.timings")
