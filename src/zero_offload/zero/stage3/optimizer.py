"""`Stage3Optimizer`: ZeRO stage 3 -- parameters, gradients and optimizer states all partitioned.

Same face as the stage 0-2 `ZeroOptimizer`. Each param group's partition on a rank is its shards of every unit in the
group, back to back; the optimizer steps it in place and the next forward gathers the updated shards. What happens to
a unit between steps (gather, release, prefetch, reduce-scatter) is `UnitLifecycle`'s alone.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from zero_offload.comm import DistContext, device_free_bytes, gather_objects
from zero_offload.config import Config
from zero_offload.nvme.setup import build_param_store
from zero_offload.offload.copies import make_copies
from zero_offload.zero.base import BuildStep, MemoryKind, ZeroOptimizerBase
from zero_offload.zero.no_step import NoStep
from zero_offload.zero.grad_partition import GradPartition, accumulates_fp32
from zero_offload.zero.split_partition import split_partition
from zero_offload.zero.collectives import scattered_dtype
from zero_offload.zero.layout import GroupLayout, place_slots
from zero_offload.zero.averaging import GradAveraging
from zero_offload.zero.stage3.frozen import build_frozen_units, frozen_names
from zero_offload.zero.stage3.lifecycle import UnitLifecycle
from zero_offload.zero.stage3.materialize import materialize
from zero_offload.zero.stage3.partition_store import ResidentStore
from zero_offload.zero.stage3.schedule import FetchSchedule
from zero_offload.zero.stage3 import registry
from zero_offload.zero.stage3.units import ShardedUnit, modules_owning, units_by_module
from zero_offload.zero.zero_optimizer import communication_dtype

__all__ = ["Stage3Optimizer"]


@dataclass(frozen=True)
class ParamFacts:
    """A stage-3 parameter as DeepSpeed's ``ds_*`` attributes describe it.

    Attributes:
        shape: the whole parameter's shape (``ds_shape``); ``numel`` its elements (``ds_numel``).
        available: its unit is gathered, so ``.data`` holds the whole values (``ds_status`` AVAILABLE).
        local: this rank's elements of it, a 1-D view into the unit's shard (``ds_tensor``; may be empty), or
            None before the shards are bound.
        persistent: kept gathered across steps (``ds_persist``: at most ``stage3_param_persistence_threshold``).
    """
    shape: tuple
    numel: int
    available: bool
    local: torch.Tensor | None
    persistent: bool


class Stage3Optimizer(ZeroOptimizerBase):
    """ZeRO stage 3 over the given param groups, optionally with parameters and/or optimizer on the host.

    Args:
        groups: `ParamGroup`s of trainable parameters (on the CPU or meta device, in the training dtype); none
            for a frozen model run forward only (`zero_offload.inference.InferenceEngine`). The model's frozen
            parameters are sharded too, in frozen units (`zero_offload.zero.stage3.frozen`).
        param_init_fn: for a model built under `init_sharded`: called as ``param_init_fn(module)`` to
            initialise each module's materialised parameters (default: ``module.reset_parameters()``).
        build_step: builds the partition optimizer (`zero_offload.hoststep.builder.build_partition_optimizer`);
            None only without trainable groups.

    Raises:
        ValueError: trainable groups without ``build_step``.
    """

    stage = 3

    def __init__(self, ctx: DistContext, config: Config, model: torch.nn.Module, groups, gradient_accumulation: int,
                 dtype: torch.dtype, param_init_fn=None, build_step: BuildStep | None = None):
        zc = config.zero_optimization
        self.ctx = ctx
        self.reduce_ctx = ctx.for_reductions()      # reduce-scatters on a group of their own (a collective call)
        self.offload = zc.offload_optimizer.device in ("cpu", "nvme")
        self.offload_param = zc.offload_param.device in ("cpu", "nvme")
        self.param_nvme = zc.offload_param.device == "nvme"
        self.copies = make_copies(ctx.device, zc.offload_optimizer.pin_memory or zc.offload_param.pin_memory)
        self._build_all_units(model, groups, dtype, zc.stage3_param_persistence_threshold)
        self._lay_out_partitions(dtype)
        self.frozen_by_name = frozen_names(model, self.frozen_units)
        # Frozen units stay in memory (host memory with offload_param nvme); the trainable ones go to the store.
        self.store = (build_param_store(self.trainable_units, [p.numel() for p in self.parts], dtype, config,
                                        ctx.rank) if self.param_nvme else ResidentStore())
        module_units = units_by_module(model, self.units)
        self.peak_materialize_bytes = materialize(model, self.units, module_units, self._bind, ctx.device, dtype,
                                                  param_init_fn)
        self._build_step(config, groups, dtype, gradient_accumulation, build_step)
        self._attach(model, module_units, config)

    def _build_all_units(self, model, groups, dtype, threshold: int) -> None:
        """The trainable units of every group, in module order, then the frozen ones."""
        self.units: list[ShardedUnit] = []
        for g, group in enumerate(groups):
            self.units += self._build_units(model, g, group, dtype, threshold)
        self.group_units = [[u for u in self.units if u.group == g] for g in range(len(groups))]
        self.trainable_units = list(self.units)
        self.frozen_units = build_frozen_units(model, len(self.units), self.ctx.world_size, self.ctx.device, dtype,
                                               threshold)
        self.units += self.frozen_units

    def _lay_out_partitions(self, dtype) -> None:
        """The rank's partition of each group: its shards of every unit, back to back (``parts``), and the
        frozen units' shards likewise (``frozen_part``). With offload_param nvme the partitions live in swap
        files (the store) and ``parts`` only carry their shapes and dtype (meta tensors)."""
        def place(units) -> int:
            numel = 0
            for u in units:
                numel = u.place(numel)
            return numel
        sizes = [place(units) for units in self.group_units]
        self.parts = [torch.empty(n, dtype=dtype, device="meta") if self.param_nvme else self._param_storage(n, dtype)
                      for n in sizes]
        self.frozen_part = self._param_storage(place(self.frozen_units), dtype)

    def _attach(self, model, module_units, config: Config) -> None:
        """The unit life cycle (its module and gradient hooks) and the registry of managed parameters."""
        zc = config.zero_optimization
        schedule = FetchSchedule(self.units, zc.stage3_prefetch_bucket_size, zc.stage3_max_live_parameters,
                                 zc.stage3_max_reuse_distance)
        self.lifecycle = UnitLifecycle(self.ctx, self.copies, self.units, module_units, schedule, self.store,
                                       self.partitions, GradAveraging.from_config(config, self.ctx.world_size),
                                       communication_dtype(config), self.reduce_ctx)
        self.lifecycle.attach_root(model)
        registry.manage(self.lifecycle.unit_of.keys(), self)   # for `gathered_parameters` and external parameters

    def _build_step(self, config: Config, groups, dtype, gradient_accumulation: int,
                    build_step: BuildStep | None) -> None:
        """Gradient partitions and the partition optimizer."""
        if groups and build_step is None:
            raise ValueError("Stage3Optimizer: trainable param groups need build_step (the partition optimizer's "
                             "builder, zero_offload.hoststep.builder.build_partition_optimizer)")
        # The step runs where the states are; with parameters on the host it runs there too.
        host_step = self.offload or self.offload_param
        # gradients_on_device: the partition stays where it is reduced; the host step pulls it down
        self.grads_on_host = host_step and not config.zero_optimization.offload_optimizer.gradients_on_device
        if not groups:           # a frozen model (forward only): shards, no gradients, no optimizer state
            self.partitions, self.adam = [], NoStep()
            return
        # Pieces arrive as reduce-scattered unit shards.
        piece_dtype = scattered_dtype(self.ctx.world_size, communication_dtype(config), dtype)
        ratio = config.zero_optimization.offload_optimizer.ratio     # < 1: part of it stays on the device
        fp32_sum = accumulates_fp32(config, gradient_accumulation)
        pieces = [max((u.shard_numel for u in units), default=0) for units in self.group_units]
        self.partitions = [split_partition(p.numel(), ratio, dtype, self.ctx.device, 3, fp32_sum, self.copies,
                                           piece_numel=n, piece_dtype=piece_dtype) if ratio < 1.0 else
                           GradPartition(p.numel(), dtype, self.ctx.device, 3, self.grads_on_host, fp32_sum,
                                         self.copies, piece_numel=n, piece_dtype=piece_dtype)
                           for p, n in zip(self.parts, pieces)]
        self.adam = build_step(config, self.parts, [g.hparams for g in groups], self.copies,
                               self.ctx.rank, offload=host_step, host_params=self.offload_param,
                               param_store=self.store if self.param_nvme else None,
                               cuts=[p.cut for p in self.partitions] if ratio < 1.0 else None,
                               layouts=self.layout(), ctx=self.ctx)

    def _build_units(self, model, g: int, group, dtype, threshold: int) -> list[ShardedUnit]:
        """One unit per module that owns (first holds) some of the group's parameters, in module order."""
        index_of = {id(p): (i, n) for p, i, n in zip(group.params, group.indices, group.names)}
        return [ShardedUnit(len(self.units) + k, g, name, own, [index_of[id(p)][1] for p in own],
                            [index_of[id(p)][0] for p in own], self.ctx.world_size, self.ctx.device, dtype, threshold)
                for k, (name, own) in enumerate(modules_owning(model, lambda p: id(p) in index_of))]

    def _param_storage(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return (self.copies.host_empty(numel, dtype) if self.offload_param
                else torch.empty(numel, dtype=dtype, device=self.ctx.device))

    def _bind(self, u: ShardedUnit) -> None:
        """Give unit ``u`` its slice of the group partition, filled from its full (materialised) buffer."""
        lo = u.partition_offset
        self.ctx.broadcast_from_first([u.full])   # every rank shards rank 0's initial weights
        if self.param_nvme and not u.frozen:
            self.store.write_shard(u, u.full[self.ctx.rank * u.shard_numel:(self.ctx.rank + 1) * u.shard_numel])
        else:
            part = self.frozen_part if u.frozen else self.parts[u.group]
            u.bind(part[lo:lo + u.shard_numel], lo, self.ctx.rank)

    @torch.no_grad()
    def write_back(self, u: ShardedUnit, src_rank: int) -> None:
        """Keep what rank ``src_rank`` wrote into gathered unit ``u``: broadcast its full buffer from there and
        write this rank's 16-bit shard and fp32 master slice from it (DeepSpeed's
        ``GatheredParameters(modifier_rank=...)``, which also updates the fp32 partitions)."""
        if self.ctx.distributed:
            self.ctx.broadcast_from(u.full, src_rank)
        mine = u.full[self.ctx.rank * u.shard_numel:(self.ctx.rank + 1) * u.shard_numel]
        self.lifecycle.shards_changed()
        if u.frozen:
            u.shard.copy_(mine)
            return            # no master weights
        self.store.write_shard(u, mine)
        self.adam.write_master(u.group, u.partition_offset, mine)

    def gather_count(self) -> int:
        """Unit gathers so far (every fetch, prefetches included)."""
        return self.lifecycle.fetch_count

    def reduction_count(self) -> int:
        """Unit reduce-scatters launched so far."""
        return self.lifecycle.in_flight.launched

    def regather_count(self) -> int:
        """Units gathered again because backward read a parameter autograd saved after its unit's release."""
        return self.lifecycle.saved_params.regathered

    # -- parameters used outside their module's forward ---------------------------------------------------
    def manages(self, p: torch.Tensor) -> bool:
        """True when ``p`` lives in one of this optimizer's units (trainable or frozen)."""
        return p in self.lifecycle.unit_of

    def parameter_viewed_by(self, t: torch.Tensor) -> torch.nn.Parameter | None:
        """The parameter of which ``t`` is an exact alias (same storage, offset, shape and strides: how autograd
        unpacks a saved parameter under saved-tensor hooks), or None."""
        u = self.lifecycle.saved_params.unit_viewed_by(t)
        p = u.param_at(t.storage_offset(), t.shape) if u is not None else None
        return p if p is not None and p.stride() == t.stride() else None

    def describe(self, p: torch.Tensor) -> ParamFacts | None:
        """What DeepSpeed's stage-3 attributes say of ``p`` now (`ParamFacts`), or None when no unit holds it."""
        u = self.lifecycle.unit_of.get(p)
        if u is None:
            return None
        slot = u.slots[[q is p for q in u.params].index(True)]
        start = self.ctx.rank * u.shard_numel
        lo, hi = min(max(slot.offset - start, 0), u.shard_numel), min(max(slot.end - start, 0), u.shard_numel)
        local = u.shard[lo:hi] if u.shard is not None else None
        return ParamFacts(tuple(slot.shape), slot.numel, u.gathered, local, u.persistent)

    @contextlib.contextmanager
    def gathered(self, params, modifier_rank: int | None):
        """The units holding ``params`` gathered for the body; with ``modifier_rank`` rank's writes kept,
        without it discarded (see `zero_offload.gathered_parameters`)."""
        life = self.lifecycle
        units = sorted({u.index: u for u in map(life.unit_of.get, params) if u is not None}.values(),
                       key=lambda u: u.index)     # one gather order on every rank, whatever the params' order
        opened = [u for u in units if life.ensure_gathered(u)]
        try:
            yield
            if modifier_rank is not None:
                for u in units:
                    self.write_back(u, modifier_rank)
        finally:
            # Outside a training micro-step, views of the gathered values the body kept stay valid
            # (`ShardedUnit.release`); inside one the storage stays the unit's, for the saved views it regathers.
            keep = not life.saved_params.active
            for u in opened:
                life.release(u, keep_views=keep)
            if modifier_rank is None:
                for u in units:
                    if u not in opened:      # a unit that stays gathered: drop the writes made to it
                        life.release(u, keep_views=keep)
                        life.gather(u)

    def release_gathered(self) -> None:
        """Free every gathered unit, persistent ones too (gathered again at their next use)."""
        self.lifecycle.invalidate()

    @contextlib.contextmanager
    def gathered_for_generation(self, free_bytes: int | None = None):
        """Every unit gathered once for the body and kept (yields True), where the units not yet gathered fit in
        ``free_bytes`` (default: the device's free memory, or the host's available memory on a CPU device) on
        every rank; else the body runs with units gathered module by module, as in any forward. A collective;
        TRL's ``ds3_gather_for_generation`` (``GatheredParameters`` over the model, hooks removed) under DeepSpeed."""
        life = self.lifecycle
        need = sum(u.nbytes for u in self.units if not u.gathered)
        fits = need <= (device_free_bytes(self.ctx.device) if free_bytes is None else free_bytes)
        # Every rank gathers the same way, or their all-gathers would not match: whole only where all fit.
        if life.held or not all(gather_objects(fits, self.ctx.group)):
            yield life.held
            return
        opened = life.hold_all()
        try:
            yield True
        finally:
            life.let_go(opened)

    def add_external(self, module: torch.nn.Module, p: torch.nn.Parameter) -> None:
        """Gather ``p``'s unit before ``module``'s forward too (``register_external_parameter``)."""
        u = self.lifecycle.unit_of.get(p)
        if u is not None:
            self.lifecycle.add_external(module, u)

    @property
    def partitions_count(self) -> int:
        return self.ctx.world_size

    # -- micro-steps (the engine's calls; the unit life cycle does the work) -------------------------------
    def begin_forward(self) -> None:
        """A training forward starts: the fetch order is recorded (first one) or replayed from here."""
        self.lifecycle.begin_forward()

    def begin_micro_step(self, boundary: bool, first_micro_step: bool) -> None:
        self.lifecycle.begin_backward(first_micro_step)

    def end_micro_step(self) -> None:
        self.lifecycle.end_backward()

    def step(self, grad_scale: float) -> None:
        # Gathered copies go stale, and the host must not rewrite a host shard a copy up still reads.
        self.lifecycle.invalidate()
        self.adam.step(self.partitions, grad_scale)
        self.publish_readers()

    # -- the delayed parameter update (see zero_offload.hoststep.delayed) --------------------------------
    def publish(self) -> None:
        """Write the parameters of the last detached step into the shards; the next forward gathers them."""
        self.lifecycle.invalidate()
        self.adam.publish()
        self.publish_readers()

    def zero_grad(self) -> None:
        pass   # partitions are overwritten by the first micro-step of the next accumulation

    def after_load(self) -> None:
        self.lifecycle.invalidate()

    def close(self) -> None:
        """`ZeroOptimizerBase.close`, then the parameter store's (NVMe: its I/O threads and swap files)."""
        self.lifecycle.invalidate()
        try:
            super().close()
            self.store.close()
        finally:
            if self.reduce_ctx is not self.ctx:
                self.reduce_ctx.close()

    # -- frozen parameters (zero_offload.runtime.state.PartitionedOptimizerState) ----------------------------------
    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(u.slots[i].shape) for name, (u, i) in self.frozen_by_name.items()}

    @torch.no_grad()
    def frozen_state(self, every_rank: bool = True) -> dict[str, torch.Tensor]:
        """{name: CPU tensor in the training dtype} of every frozen parameter, tied aliases included: a
        collective that gathers one frozen unit at a time (the device holds one unit beyond the shards). With
        ``every_rank=False`` only rank 0 copies to the host and the other ranks return {}."""
        host = {}
        keep = every_rank or self.ctx.rank == 0
        for u in self.frozen_units:
            opened = self.lifecycle.ensure_gathered(u)
            if keep:
                for i, s in enumerate(u.slots):
                    host[u.index, i] = u.full[s.offset:s.end].view(s.shape).to("cpu", copy=True)
            if opened:
                self.lifecycle.release(u)
        return {name: host[u.index, i] for name, (u, i) in self.frozen_by_name.items() if (u.index, i) in host}

    @torch.no_grad()
    def load_frozen_state(self, values: dict[str, torch.Tensor]) -> None:
        """Write this rank's shard of each frozen parameter named in ``values`` (full tensors, any float dtype);
        frozen parameters not named keep their values. Local: every rank reads the same full values."""
        self.lifecycle.invalidate()
        lo_of = lambda u: self.ctx.rank * u.shard_numel   # noqa: E731
        for u in self.frozen_units:
            if not any(s.name in values for s in u.slots):
                continue
            flat = torch.zeros(u.padded_numel, dtype=u.shard.dtype)
            flat[lo_of(u):lo_of(u) + u.shard_numel] = u.shard.cpu()
            for s in u.slots:
                if s.name in values:
                    flat[s.offset:s.end] = values[s.name].reshape(-1)
            u.shard.copy_(flat[lo_of(u):lo_of(u) + u.shard_numel])

    def layout(self) -> list[GroupLayout]:
        """Per group: each unit cut into ``world_size`` shards, rank r's shard stored from the unit's
        ``partition_offset`` in rank r's group partition."""
        return [GroupLayout(part.numel(), tuple(p for u in units
                                                for p in place_slots(u.slots, u.shard_numel, u.partition_offset)))
                for units, part in zip(self.group_units, self.parts)]

    def memory_kinds(self) -> dict[str, MemoryKind]:
        """The kinds of `memory_breakdown` at stage 3: ``params`` are this rank's shards, ``gathered`` the full buffers
        gathered right now and ``peak_gathered`` the most at once, then `partition_kinds` (fp32 masters that are the
        shards themselves left out), ``frozen_params`` this rank's shards of the frozen parameters and
        ``nvme_buffers`` (empty unless the states are on NVMe). With ``offload_param.device = nvme``, ``params`` are
        the swap files' bytes (side ``nvme``), ``param_pool`` the host buffers they are read into and
        ``param_write_ring`` those their writes behind the step go out from (frozen shards stay in host memory)."""
        param_side = "host" if self.offload_param else "device"
        if self.param_nvme:   # the partitions are swap files; the host holds the store's buffer pool
            params = {"params": {"bytes": self.store.bytes_on_disk, "numel": sum(p.numel() for p in self.parts),
                                 "side": "nvme"},
                      "param_pool": ("host", self.store.tensors()),
                      "param_write_ring": ("host", self.store.write_ring_tensors())}
        else:
            params = {"params": (param_side, list(self.parts))}
        kinds = self.partition_kinds()
        side, masters = kinds.get("master", ("host", []))
        aliased = {p.data_ptr() for p in self.parts}
        kinds["master"] = (side, [m for m in masters if m.data_ptr() not in aliased])
        return {**params,
                "gathered": {"bytes": self.lifecycle.live_bytes, "numel": self.lifecycle.live_numel, "side": "device"},
                "peak_gathered": {"bytes": self.lifecycle.peak_live_bytes, "numel": 0, "side": "device"},
                **kinds,
                "frozen_params": (param_side, [self.frozen_part]),
                "nvme_buffers": kinds.get("nvme_buffers", ("host", []))}
