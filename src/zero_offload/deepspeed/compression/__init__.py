"""``deepspeed.compression``: not built in zero-offload (model compression). Every name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError` saying what to use instead."""
from zero_offload.compat.unbuilt import unbuilt_module_getattr

__getattr__ = unbuilt_module_getattr("deepspeed.compression", "compress with a dedicated library (e.g. torch.ao) after training")
