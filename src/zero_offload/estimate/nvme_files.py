"""The NVMe side of a rank's memory estimate (`zero_offload.estimate.memory`): swap files, and the host pools and
staging they stream through, sized with the NVMe layer's own functions."""
from __future__ import annotations

import torch

from zero_offload.config import Config
from zero_offload.estimate.shape import ModelShape
from zero_offload.zero.flat import partition_numel

__all__ = ["add_nvme_files"]


def add_nvme_files(est, cfg: Config, shape: ModelShape, parts: list[int], world_size: int,
                   dtype: torch.dtype, accelerator: bool) -> None:
    """The NVMe side of a rank (`zero_offload.nvme`): optimizer-state files in whole sub-groups and their host
    pool (``nvme_buffers``) and 16-bit staging; parameter files, their read pool (``param_pool``) and the ring
    their writes behind the step go out from (``param_write_ring``), added to ``est``: the
    `zero_offload.estimate.memory.MemoryEstimate` being filled (which calls this)."""
    from zero_offload.nvme import state_files                 # imported here: the NVMe layer is optional
    from zero_offload.nvme.param_store import NvmeParamStore
    zc = cfg.zero_optimization
    d = torch.empty((), dtype=dtype).element_size()
    param_nvme = zc.stage == 3 and zc.offload_param.device == "nvme"
    if zc.offload_optimizer.device == "nvme":
        sizes = state_files.element_sizes(cfg)            # bf16 masters or moments: 2 bytes per element
        sub = state_files.sub_group_numel(parts, zc.sub_group_size, sizes)
        for kind, nbytes in state_files.kind_bytes(parts, zc.sub_group_size, sizes, shape.muon_groups).items():
            est.add("nvme", kind, nbytes)
        oo = zc.offload_optimizer
        if oo.super_offload:       # the second bank of state files the speculated sub-groups are written to
            est.add("nvme", "speculative_state", state_files.bytes_needed(parts, zc.sub_group_size, sizes))
        est.add("host", "nvme_buffers", state_files.pool_bytes(parts, zc.sub_group_size, oo.buffer_count,
                                                               oo.pipeline_read, oo.pipeline_write, sizes))
        # 16-bit outputs of fp32 masters leave through one staging slot per buffer (bf16 masters: from the pool)
        if d < 4 and not cfg.bf16.bf16_master_weights_and_grads and (accelerator or param_nvme):
            sub_groups = sum(-(-n // sub) for n in parts)
            slots = state_files.pool_slots(oo.buffer_count, oo.pipeline_read, oo.pipeline_write)
            est.add("host", "param_staging", min(slots, sub_groups) * sub * d)
    if param_nvme:
        est.add("nvme", "params", NvmeParamStore.bytes_needed(parts, dtype))
        largest = max(partition_numel(n, world_size) for _, _, n in shape.units)
        est.add("host", "param_pool", NvmeParamStore.pool_bytes(largest, dtype, zc.offload_param.buffer_count))
        est.add("host", "param_write_ring", NvmeParamStore.write_ring_bytes())
    est.formulas["nvme"] = ("states: 3 files (a Muon group 2) of whole sub-groups (sub_group_size, aligned to 4 "
                            "KiB) x 4 B (2 B: bf16 masters or moments); pool: min(buffer_count, 1 + pipeline_read + "
                            "pipeline_write) x 12 B (less with bf16) x sub-group (super_offload: "
                            "the state files twice); params: one file per group, d B per element, read "
                            "through buffer_count buffers of the largest shard, written behind the step through a "
                            f"ring of {NvmeParamStore.write_ring_bytes() >> 20} MiB")
