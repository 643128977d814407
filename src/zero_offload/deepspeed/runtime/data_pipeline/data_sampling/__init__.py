"""``deepspeed.runtime.data_pipeline.data_sampling``: not built in zero-offload (DeepSpeed's data-efficiency pipeline). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError` saying what to use instead."""
from zero_offload.compat.unbuilt import unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.runtime.data_pipeline.data_sampling", "use a torch DataLoader")
