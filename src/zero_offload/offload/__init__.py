"""Host-memory offload: exact-size pinned buffers, copy streams and events, the delayed parameter update."""
from zero_offload.offload.copies import DONE, CopyEngine, CopyHandle, Copies, CudaCopies, HostCopies, host_empty

__all__ = ["CopyEngine", "CopyHandle", "Copies", "CudaCopies", "HostCopies", "DONE", "host_empty"]
