"""Host-memory offload: exact-size pinned buffers, copy streams and events, the staging ring of copies up.

The delayed parameter update schedules the step, so it lives with the step: `zero_offload.hoststep.delayed`.
"""
from zero_offload.offload.copies import DONE, CopyEngine, CopyHandle, Copies, CudaCopies, HostCopies, host_empty

__all__ = ["CopyEngine", "CopyHandle", "Copies", "CudaCopies", "HostCopies", "DONE", "host_empty"]
