"""Host-memory offload: pinned buffers and the copy stream that moves partitions between device and host."""
from zero_offload.offload.copies import CopyEngine, host_empty

__all__ = ["CopyEngine", "host_empty"]
