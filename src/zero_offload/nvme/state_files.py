"""The layout of the optimizer states' swap files and their host buffer pool (sizes only, no I/O).

One file per param group and state (the master and both moments: fp32, or bf16 where the config asks), written
whole sub-groups at a time through a pool of aligned host buffers (`zero_offload.hoststep.nvme_adam.NvmeAdam`);
the checks at initialize (`zero_offload.nvme.setup`) and the estimate (`zero_offload.estimate.memory`) size them
with these functions.
"""
from __future__ import annotations

from zero_offload.nvme.buffers import align_up
from zero_offload.runtime.state import STATE_KINDS

__all__ = ["STATE_FILES", "FP32", "FP32_SIZES", "sub_group_numel", "pool_slots", "pool_bytes", "bytes_needed",
           "kind_bytes", "file_bytes", "element_sizes"]

FP32 = 4
FP32_SIZES = (FP32, FP32, FP32)      # bytes per element of the master, exp_avg and exp_avg_sq files
STATE_FILES = tuple(f".{kind}.swp" for kind in STATE_KINDS)    # name endings of the states' swap files


def element_sizes(config) -> tuple[int, int, int]:
    """Bytes per element of the three state files under ``config`` (a `zero_offload.config.Config`): the master (4,
    or 2 with ``bf16.bf16_master_weights_and_grads``) and both moments (4, or 2 with
    ``bf16.bf16_optimizer_states``)."""
    moment = config.bf16.state_dtype.itemsize
    return config.bf16.master_dtype.itemsize, moment, moment


def sub_group_numel(numels: list[int], sub_group_size: int, sizes: tuple[int, ...] = FP32_SIZES) -> int:
    """Elements per sub-group for partitions of ``numels``: ``sub_group_size``, at most the largest partition,
    rounded up so that a sub-group of the narrowest state is whole 4096-byte blocks (the O_DIRECT alignment): 1024
    elements with fp32 states, 2048 with a 2-byte one."""
    narrow = min(sizes)
    return align_up(min(sub_group_size, max(max(numels), 1)) * narrow) // narrow


def pool_slots(buffer_count: int, pipeline_read: bool, pipeline_write: bool) -> int:
    """Sub-group buffers the pool holds: those in flight at once -- the one stepped, one read ahead with
    ``pipeline_read``, one written behind with ``pipeline_write`` -- and at most ``buffer_count``. A buffer more
    would never overlap anything, yet the round robin would touch its pages."""
    return max(1, min(buffer_count, 1 + pipeline_read + pipeline_write))


def pool_bytes(numels: list[int], sub_group_size: int, buffer_count: int, pipeline_read: bool = False,
               pipeline_write: bool = False, sizes: tuple[int, ...] = FP32_SIZES) -> int:
    """Host bytes of the sub-group pool for partitions of ``numels``: `pool_slots` aligned buffers of the three
    states of one sub-group (``sizes`` bytes per element each)."""
    slots = pool_slots(buffer_count, pipeline_read, pipeline_write)
    return slots * align_up(sum(sizes) * sub_group_numel(numels, sub_group_size, sizes))


def file_bytes(numel: int, sub: int, size: int = FP32) -> int:
    """Bytes of one state file of a partition of ``numel`` elements of ``size`` bytes, in whole sub-groups of
    ``sub`` elements."""
    return -(-numel // sub) * sub * size


def kind_bytes(numels: list[int], sub_group_size: int, sizes: tuple[int, ...] = FP32_SIZES,
               muon_groups: frozenset[int] = frozenset()) -> dict[str, int]:
    """Bytes of swap files per state kind for partitions of ``numels`` elements (``sizes`` bytes per element),
    whole sub-groups; a group of ``muon_groups`` (optimizer type Muon) keeps a master and a momentum (under
    ``exp_avg``), no ``exp_avg_sq``."""
    sub = sub_group_numel(numels, sub_group_size, sizes)
    return {kind: sum(file_bytes(n, sub, size) for g, n in enumerate(numels)
                      if not (kind == "exp_avg_sq" and g in muon_groups))
            for kind, size in zip(STATE_KINDS, sizes)}


def bytes_needed(numels: list[int], sub_group_size: int, sizes: tuple[int, ...] = FP32_SIZES,
                 muon_groups: frozenset[int] = frozenset()) -> int:
    """Bytes of swap files for partitions of ``numels`` elements: every state kind's (`kind_bytes`)."""
    return sum(kind_bytes(numels, sub_group_size, sizes, muon_groups).values())
