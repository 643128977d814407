"""Host-memory offload: exact-size pinned buffers, copy streams and events (`make_copies` picks the copies of a
device), the staging ring of copies up, the gradient buffer lent to a step beside training.

The host-step policies that use them live with the step: `zero_offload.hoststep`.
"""
from zero_offload.offload.copies import DONE, CopyHandle, Copies, CudaCopies, HostCopies, host_empty, make_copies

__all__ = ["make_copies", "CopyHandle", "Copies", "CudaCopies", "HostCopies", "DONE", "host_empty"]
