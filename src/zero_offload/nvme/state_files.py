"""The layout of the optimizer states' swap files and their host buffer pool (sizes only, no I/O).

One file per param group and state (the fp32 master and both moments), written whole sub-groups at a time through a
pool of aligned host buffers (`zero_offload.hoststep.nvme_adam.NvmeAdam`); the checks at initialize
(`zero_offload.nvme.setup`) and the estimate (`zero_offload.estimate.memory`) size them with these functions.
"""
from __future__ import annotations

from zero_offload.nvme.buffers import align_up
from zero_offload.state import STATE_KINDS

__all__ = ["STATE_FILES", "FP32", "sub_group_numel", "pool_slots", "pool_bytes", "bytes_needed", "file_bytes"]

FP32 = 4
STATE_FILES = tuple(f".{kind}.swp" for kind in STATE_KINDS)    # name endings of the states' swap files


def sub_group_numel(numels: list[int], sub_group_size: int) -> int:
    """Elements per sub-group for partitions of ``numels``: ``sub_group_size``, at most the largest partition,
    rounded up to 1024 (4096 bytes of fp32, the O_DIRECT alignment)."""
    return align_up(min(sub_group_size, max(max(numels), 1)) * FP32) // FP32


def pool_slots(buffer_count: int, pipeline_read: bool, pipeline_write: bool) -> int:
    """Sub-group buffers the pool holds: those in flight at once -- the one stepped, one read ahead with
    ``pipeline_read``, one written behind with ``pipeline_write`` -- and at most ``buffer_count``. A buffer more
    would never overlap anything, yet the round robin would touch its pages."""
    return max(1, min(buffer_count, 1 + pipeline_read + pipeline_write))


def pool_bytes(numels: list[int], sub_group_size: int, buffer_count: int, pipeline_read: bool = False,
               pipeline_write: bool = False) -> int:
    """Host bytes of the sub-group pool for partitions of ``numels``: `pool_slots` aligned buffers of the three
    fp32 states of one sub-group."""
    slots = pool_slots(buffer_count, pipeline_read, pipeline_write)
    return slots * align_up(3 * sub_group_numel(numels, sub_group_size) * FP32)


def file_bytes(numel: int, sub: int) -> int:
    """Bytes of one state file of a partition of ``numel`` elements, in whole sub-groups of ``sub`` elements."""
    return -(-numel // sub) * sub * FP32


def bytes_needed(numels: list[int], sub_group_size: int) -> int:
    """Bytes of swap files for partitions of ``numels`` elements: 3 fp32 states, whole sub-groups."""
    sub = sub_group_numel(numels, sub_group_size)
    return sum(3 * file_bytes(n, sub) for n in numels)
