"""`build_partition_optimizer`: the one place that chooses a rank's partition optimizer from the config, for both
ZeRO optimizers. What it builds (every one fills `zero_offload.hoststep.role.PartitionOptimizer`; type Muon:
`PartitionedMuon`, `NvmeMuon`):

=========================  ==========================  ===========  ==============================================
offload_optimizer.device   optimizer                   parameters   partition optimizer
=========================  ==========================  ===========  ==============================================
none / cpu                 Adam, AdamW (no amsgrad)    in memory    `PartitionedAdam`: the fused host kernel where
                                                                    the states are on the host, else torch's fused
                                                                    device AdamW
none / cpu                 amsgrad, Lamb (stages 0-2)  in memory    `PartitionedTorchOptimizer`
                           or a torch.optim type
nvme                       Adam, AdamW (no amsgrad)    any          `NvmeAdam` (writing the parameter swap files
                                                                    itself when the parameters are on NVMe)
cpu / nvme, ratio < 1      Adam, AdamW (no amsgrad)    on device    `SplitAdam`: a device `PartitionedAdam` over
                                                                    the first part, the host part as above
none / cpu                 any of the above            NVMe         `WriteBackOptimizer` over one of the first two,
                                                                    built on fp32 masters read from the files
=========================  ==========================  ===========  ==============================================

DeepSpeed makes the same choice in ``DeepSpeedEngine._configure_basic_optimizer`` (``DeepSpeedCPUAdam`` when the
optimizer is offloaded, ``FusedAdam`` on the device, ``torch.optim.<type>`` by name otherwise), and swaps the states
to NVMe with ``PartitionedOptimizerSwapper`` (``PipelinedOptimizerSwapper`` with ``pipeline_read``/``_write``).
"""
from __future__ import annotations

import torch

from zero_offload.config import Config, ConfigError
from zero_offload.config.optim import muon_clips_update
from zero_offload.hoststep.adam import PartitionedAdam
from zero_offload.hoststep.muon import PartitionedMuon, muon_rule
from zero_offload.hoststep.muon_owners import MuonOwners
from zero_offload.hoststep.nvme_muon import NvmeMuon
from zero_offload.hoststep.precision import master_rounding
from zero_offload.hoststep.nvme_adam import NvmeAdam
from zero_offload.hoststep.policy import StepPolicy
from zero_offload.hoststep.role import PartitionOptimizer
from zero_offload.hoststep.split import SplitAdam
from zero_offload.hoststep.torch_optimizer import PartitionedTorchOptimizer
from zero_offload.nvme.param_store import NvmeParamStore
from zero_offload.nvme.param_writeback import WriteBackOptimizer
from zero_offload.nvme.setup import check_swap_directory
from zero_offload.nvme.state_files import STATE_FILES, bytes_needed, element_sizes
from zero_offload.offload.copies import Copies
from zero_offload.offload.host_cores import host_step_cores

__all__ = ["build_partition_optimizer"]


def build_partition_optimizer(config: Config, parts: list[torch.Tensor], hparams: list[dict], copies: Copies,
                              rank: int, *, offload: bool, host_params: bool = False,
                              param_store: NvmeParamStore | None = None, segments: list | None = None,
                              all_reduce=None, cuts: list[int] | None = None, layouts: list | None = None,
                              ctx=None) -> PartitionOptimizer:
    """The partition optimizer ``config`` asks for, over this rank's ``parts``.

    Args:
        parts: per param group, this rank's 1-D parameter partition (16-bit or fp32; on the device, on the host,
            or meta tensors that give only shapes and dtypes when ``param_store`` holds the parameters).
        hparams: per group, dict(lr, betas, eps, weight_decay, adamw_mode, bias_correction).
        copies: the copy engine (page-locked host buffers, copies up).
        rank: this rank (names its NVMe swap directory).
        offload: the states and the step live on the host (``offload_optimizer.device`` cpu or nvme; at stage 3
            also ``offload_param``).
        host_params: the parts are host memory themselves (stage 3 ``offload_param.device = cpu``).
        param_store: stage 3's parameter swap files (``offload_param.device = nvme``), or None.
        segments, all_reduce: where each parameter's pieces sit in ``parts`` and how to sum per-parameter
            norms over the ranks, for ``Lamb``'s per-tensor trust ratio (`PartitionedTorchOptimizer`);
            stages 0-2 give them.
        cuts: ``offload_optimizer.ratio`` < 1: per group, the elements at the start of the part that stay on the
            device (the gradient partition's cut, `zero_offload.zero.split_partition.device_numel`); else None.
        layouts, ctx: optimizer type Muon: where each parameter sits in the ranks' partitions
            (`zero_offload.zero.layout.GroupLayout` per group) and the data-parallel group (`DistContext`), for
            the matrices' owners (`zero_offload.hoststep.muon_owners.MuonOwners`).

    Raises:
        ConfigError: ``offload_optimizer.delayed_param_update`` or ``offload_optimizer.device = nvme`` with an
            optimizer the fused kernel does not run (amsgrad, a torch.optim type, Lamb), naming the key (with
            ``gradients_on_device`` the config refuses it: `zero_offload.config.optim.check_fused_kernel_keys`); the
            swap directory's checks (`zero_offload.nvme.setup.check_swap_directory`); ``optimizer.type``
            ``Lamb`` without ``segments`` (stage 3: its units are not told apart in the partition yet).
        ValueError: ``bias_correction = false`` with the states on an accelerator.
    """
    opt = config.optimizer
    if opt.type == "Muon":
        return _muon(config, parts, hparams, copies, offload, host_params, layouts, ctx, rank, param_store)
    if opt.type == "Lamb" and segments is None:
        raise ConfigError("config key 'optimizer.type' = 'Lamb' is built at 'zero_optimization.stage' 0-2, not 3: "
                          "LAMB's per-tensor trust ratio needs each parameter's pieces in the partition (DeepSpeed "
                          "refuses Lamb under ZeRO too unless zero_allow_untested_optimizer, and then takes the "
                          "ratio over whole partitions); use stage 2, or Adam/AdamW at stage 3")
    fused = opt.torch_kwargs is None and not opt.params.amsgrad
    nvme = config.zero_optimization.offload_optimizer.device == "nvme"
    if nvme and not fused:
        raise ConfigError(f"config key 'zero_optimization.offload_optimizer.device' = 'nvme' streams Adam's "
                          f"states through its buffers; optimizer.type = {opt.type!r}"
                          f"{' with amsgrad' if opt.params.amsgrad else ''} needs device 'cpu'")
    if cuts is not None and offload and not host_params:
        if not fused:
            raise ConfigError(f"config key 'zero_optimization.offload_optimizer.ratio' = "
                              f"{config.zero_optimization.offload_optimizer.ratio} needs optimizer type Adam/AdamW "
                              f"without amsgrad (got {opt.type!r}): the two parts are stepped by the fused kernels")
        # The device part: torch's fused AdamW where the parameters live; the host part as any offloaded step
        # (its states in host memory, or in swap files under nvme).
        chunk = config.zero_optimization.offload_optimizer.copy_chunk
        on_device = PartitionedAdam([p[:c] for p, c in zip(parts, cuts)], hparams, False, copies, chunk=chunk)
        rest = [p[c:] for p, c in zip(parts, cuts)]
        on_host = _nvme(rest, hparams, copies, config, rank) if nvme else \
            _in_memory(config, rest, hparams, True, copies, False)
        return SplitAdam(parts, cuts, on_device, on_host)
    if nvme:
        return _nvme(parts, hparams, copies, config, rank, param_io=param_store, host_params=host_params)
    if param_store is not None:
        # fp32 masters read from the files are the inner optimizer's parameters; the 16-bit ones are written
        # back to the files after each step.
        masters = [param_store.read_range(g, 0, p.numel()).float() for g, p in enumerate(parts)]
        return WriteBackOptimizer(_in_memory(config, masters, hparams, True, copies, True), param_store)
    return _in_memory(config, parts, hparams, offload, copies, host_params, segments, all_reduce, rank)


def _in_memory(config: Config, parts: list[torch.Tensor], hparams: list[dict], offload: bool, copies: Copies,
               host_params: bool, segments: list | None = None, all_reduce=None, rank: int = 0) -> PartitionedAdam:
    """States in device or host memory: the fused kernel for Adam/AdamW, a torch optimizer otherwise."""
    opt = config.optimizer
    offload_opt = config.zero_optimization.offload_optimizer
    policy = StepPolicy.from_config(config)
    if opt.torch_kwargs is None and not opt.params.amsgrad:
        # A step beside the training thread gets its share of the cores; a synchronous one every core.
        cores = host_step_cores(offload_opt.cpuadam_cores_perc) if policy.beside_training else None
        # Stochastic rounding's element numbering: rank r's partition starts at r x its size (stages 1-2: the
        # flat buffer's own offsets, so the bits do not depend on the world size).
        return PartitionedAdam(parts, hparams, offload, copies, host_params=host_params, policy=policy,
                               state_dtype=config.bf16.state_dtype, host_cpus=cores, chunk=offload_opt.copy_chunk,
                               speculated=offload_opt.super_offload_fraction, master_dtype=config.bf16.master_dtype,
                               index_bases=[rank * p.numel() for p in parts],
                               grads_on_device=offload and offload_opt.gradients_on_device, **master_rounding(config))
    if config.bf16.master_dtype != torch.float32:
        raise ConfigError("config key 'bf16.bf16_master_weights_and_grads' = true needs the optimizer Adam/AdamW on "
                          "the fused host kernel (DeepSpeed: DeepSpeedCPUAdam); a client optimizer, amsgrad or "
                          f"{opt.type!r} steps fp32 masters")
    if policy.beside_training:
        key = "delayed_param_update" if policy is StepPolicy.DELAYED else "super_offload"
        raise ConfigError(f"config key 'zero_optimization.offload_optimizer.{key}' = true needs optimizer "
                          f"type Adam/AdamW without amsgrad (got {opt.type!r}): only the fused host kernel's "
                          "step runs beside training")
    return PartitionedTorchOptimizer(parts, hparams, offload, copies, host_params=host_params,
                                     type_name=opt.type, torch_kwargs=opt.torch_kwargs, segments=segments,
                                     all_reduce=all_reduce)


def _nvme(parts: list[torch.Tensor], hparams: list[dict], copies: Copies, config: Config,
         rank: int, param_io=None, host_params: bool = False, owners: MuonOwners | None = None) -> NvmeAdam:
    """The NVMe optimizer for this rank's ``parts`` as ``config`` (offload_optimizer, aio, sub_group_size)
    asks (``param_io``: see `NvmeAdam`), in a checked swap directory; with ``owners`` (type Muon) `NvmeMuon`.

    Raises:
        ConfigError: as `check_swap_directory`.
    """
    zc = config.zero_optimization
    oo = zc.offload_optimizer
    banks = 2 if oo.super_offload else 1          # super_offload: a second bank of state files
    muon = frozenset(g for g, rule in enumerate(owners.rules) if rule is not None) if owners else frozenset()
    need = banks * bytes_needed([p.numel() for p in parts], zc.sub_group_size, element_sizes(config), muon)
    directory = check_swap_directory(oo.nvme_path, rank, need, reclaimable=STATE_FILES)
    cores = host_step_cores(oo.cpuadam_cores_perc) if oo.super_offload else None
    options = dict(pipeline_read=oo.pipeline_read, pipeline_write=oo.pipeline_write,
                   block_size=config.aio.block_size, thread_count=config.aio.threads,
                   queue_depth=config.aio.queue_depth, param_io=param_io, speculative=oo.super_offload,
                   host_cpus=cores, host_params=host_params, master_dtype=config.bf16.master_dtype,
                   state_dtype=config.bf16.state_dtype, index_bases=[rank * p.numel() for p in parts],
                   **master_rounding(config))
    if owners is not None:
        return NvmeMuon(parts, hparams, copies, directory, zc.sub_group_size, oo.buffer_count, owners=owners,
                        **options)
    return NvmeAdam(parts, hparams, copies, directory, zc.sub_group_size, oo.buffer_count, **options)


def _muon(config: Config, parts, hparams, copies, offload, host_params, layouts, ctx, rank: int,
          param_store: NvmeParamStore | None):
    """Type Muon: its states where the Adam moments would be -- `PartitionedMuon` in memory, `NvmeMuon` in swap
    files, and with stage 3's parameters on NVMe the masters read from their files and written back as for Adam
    (the settings it is not built with were refused with the config: `zero_offload.config.optim.check_muon`).

    Raises:
        ValueError: no layouts or data-parallel group given.
    """
    zc = config.zero_optimization
    if layouts is None or ctx is None:
        raise ValueError("optimizer type Muon needs the partitions' layouts and the data-parallel group")
    owners = MuonOwners(layouts, [muon_rule(h) for h in hparams], [h.get("muon_heads", {}) for h in hparams],
                        ctx.rank, ctx.world_size,
                        replicated=zc.stage == 0 and ctx.world_size > 1, all_to_all=ctx.all_to_all,
                        device=ctx.device)
    if zc.offload_optimizer.device == "nvme":
        return _nvme(parts, hparams, copies, config, rank, param_io=param_store, host_params=host_params,
                     owners=owners)
    if param_store is not None:
        masters = [param_store.read_range(g, 0, p.numel()).float() for g, p in enumerate(parts)]
        return WriteBackOptimizer(PartitionedMuon(masters, hparams, True, copies, owners, host_params=True,
                                                  clip_update=muon_clips_update(config)), param_store)
    return PartitionedMuon(parts, hparams, offload, copies, owners, host_params=host_params,
                           clip_update=muon_clips_update(config))
