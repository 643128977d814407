"""`UnitLifecycle`: the one owner of the stage-3 unit life cycle, from gather to reduce-scatter, for every unit of a
model (FSDP2's ``FSDPParamGroup``: unshard, wait, reshard, the forward and backward hooks, the reduce-scatter).

ARCHITECTURE.md ("Stage 3") walks through it: units gathered before each module's forward and again for its backward,
prefetched along the order `FetchSchedule` recorded (DeepSpeed's ``PartitionedParameterCoordinator``);
reduce-scatters in one fixed order on every rank (last unit first), so a module whose output reaches the loss on some
ranks only cannot make the ranks' collectives disagree; saved parameters gathered again (`saved_params`), frozen
units released after their module's backward (`frozen`), stray reads gathered with the root (`stray_reads`).
"""
from __future__ import annotations

import torch
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from zero_offload.comm import DistContext
from zero_offload.runtime.compiling import is_compiled_module
from zero_offload.offload.copies import Copies
from zero_offload.zero.averaging import GradAveraging
from zero_offload.zero.collectives import MAX_IN_FLIGHT, InFlight, completed, finish, reduce_scatter_grad
from zero_offload.zero.grad_partition import GradPartition
from zero_offload.zero.stage3.frozen import FrozenRelease
from zero_offload.zero.stage3.gather_check import GatherCheck
from zero_offload.zero.stage3.partition_store import PartitionStore
from zero_offload.zero.stage3.saved_params import SavedParameterGuard
from zero_offload.zero.stage3.schedule import FetchSchedule
from zero_offload.zero.stage3.stray_reads import StrayReads
from zero_offload.zero.stage3.units import ShardedUnit

__all__ = ["UnitLifecycle"]

DONE = -1     # a unit's pending-gradient count once it has been reduce-scattered this micro-step


def _in_backward() -> bool:
    """True while autograd is running a backward pass (e.g. recomputing a checkpointed forward)."""
    return torch._C._current_graph_task_id() != -1


class UnitLifecycle:
    """Gathers, releases and reduce-scatters the units of one model through module and gradient hooks.

    Args:
        units: every unit (trainable, then frozen), indexed by ``ShardedUnit.index``.
        module_units: for every module that uses parameters directly, the units holding them (`units_by_module`).
        schedule: the recorded fetch order and the prefetch and reuse decisions.
        store: where the shards live between gathers (one not resident, NVMe, is read ahead in the recorded order).
        partitions: the rank's gradient partition of each param group; each reduce-scatter lands there.
    """

    def __init__(self, ctx: DistContext, copies: Copies, units: list[ShardedUnit],
                 module_units: dict[torch.nn.Module, list[ShardedUnit]], schedule: FetchSchedule,
                 store: PartitionStore, partitions: list[GradPartition], averaging: GradAveraging,
                 comm_dtype: torch.dtype | None, reduce_ctx: DistContext | None = None):
        self.ctx, self.copies, self.units, self.store = ctx, copies, units, store
        self.reduce_ctx = ctx if reduce_ctx is None else reduce_ctx   # the reduce-scatters' own group
        self.module_units, self.schedule = module_units, schedule
        self.partitions, self.averaging, self.comm_dtype = partitions, averaging, comm_dtype
        self.trainable = [u for u in units if not u.frozen]
        # CUDA: all-gathers run on their own stream, so a prefetch never queues behind compute (FSDP2's way).
        self.gather_stream = torch.cuda.Stream(ctx.device) if ctx.device.type == "cuda" else None
        self.shards_written = None    # CUDA: an event after the last writes of the shards on the compute stream
        self.live_numel = sum(u.padded_numel for u in units if u.gathered)   # the persistent ones
        self.live_bytes = sum(u.nbytes for u in units if u.gathered)
        self.peak_live_bytes = 0               # the most gathered bytes at once, measured
        self.fetch_count = 0
        self.reduce_order = sorted(self.trainable, key=lambda u: -u.index)
        self.pending = {u.index: 0 for u in self.trainable}   # gradients still to come, this micro-step
        self.next_reduce = 0
        self.first_micro_step = True
        self.last_forward_use: dict[ShardedUnit, int] = {}   # this micro-step's forward: unit -> its last fetch
        self.forward_fetches = 0
        self.backward_order: list[ShardedUnit] = []         # by last forward use, latest first
        self.backward_position: dict[ShardedUnit, int] = {}
        self.cursor = 0                                      # backward_order[:cursor] was fetched or passed over
        # reduce-scatters in flight, each unit's gradient kept
        self.in_flight = InFlight(MAX_IN_FLIGHT, self._accumulate, lambda item: completed(item[1]))
        self.saved_params = SavedParameterGuard(units, self.gather)
        self.gather_check = GatherCheck(ctx, units)
        self.frozen_release = FrozenRelease(self.release, module_units)
        # Every parameter -> its unit (trainable and frozen), by identity: a tensor's == is elementwise.
        self.unit_of = WeakIdKeyDictionary({p: u for u in units for p in u.params})
        self.root: torch.nn.Module | None = None
        self.busy = 0                      # > 0 while a hook of this life cycle runs (its reads are its own)
        self.held = False                  # every unit gathered and kept: the module hooks stand aside
        self.forward_fetched: set[ShardedUnit] = set()      # fetched by a module of the watched forward
        self.stray_reads = StrayReads(self.unit_of, self.forward_fetched, self._on_stray, lambda: self.busy > 0)
        self.hooks = []
        for module in module_units:
            self._hook_module(module)
        for u in self.trainable:
            for p in u.params:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _hook_module(self, module: torch.nn.Module) -> None:
        # torch.compile never traces them (a gather swaps the parameters' storage: AOTAutograd refuses a set_ on a
        # graph input): dynamo breaks the graph at each and runs it eagerly, so a compiled model, whole or per
        # block, sees its parameters gathered, and the same parameter objects every step.
        self.hooks.append(module.register_forward_pre_hook(torch.compiler.disable(self._pre_forward)))
        self.hooks.append(module.register_forward_hook(torch.compiler.disable(self._post_forward)))

    def add_external(self, module: torch.nn.Module, u: ShardedUnit) -> None:
        """Gather ``u`` before ``module``'s forward too (``register_external_parameter``)."""
        if module not in self.module_units:
            self.module_units[module] = []
            self._hook_module(module)
        if u not in self.module_units[module]:
            self.module_units[module].append(u)

    def gather(self, u: ShardedUnit, async_op: bool = False) -> None:
        """All-gather unit ``u`` into its full buffer now (``async_op``: in flight until `ShardedUnit.wait`),
        out of the recorded order: nothing is traced or prefetched."""
        swapped = not self.store.resident
        if self.gather_stream is not None and self.shards_written is None:
            # The first gather since the shards changed: everything queued so far (the step, a load) wrote
            # them; the all-gather stream waits on this point, never on the compute queued after it.
            self.shards_written = torch.cuda.current_stream(self.ctx.device).record_event()
        with record_function("zero_offload.stage3.gather"):
            # A swapped shard's buffer goes back to the store right after: its gather cannot stay in flight.
            u.gather(self.ctx, self.copies, async_op and not swapped, self.gather_stream,
                     source=self.store.acquire(u) if swapped else None, shards_written=self.shards_written)
        if swapped:
            u.shard_readable()
            self.store.release(u)
        self.fetch_count += 1
        self.live_numel += u.padded_numel
        self.live_bytes += u.nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def ensure_gathered(self, u: ShardedUnit) -> bool:
        """Gather ``u`` now unless it is gathered (then wait for its gather in flight); True when gathered here."""
        if u.gathered:
            u.wait()
            return False
        self.gather(u)
        return True

    def release(self, u: ShardedUnit, keep_views: bool = False) -> None:
        """Free ``u``'s full buffer (waiting for its gather in flight first); ``keep_views``: see
        `ShardedUnit.release`."""
        u.release(keep_views)
        self.live_numel -= u.padded_numel
        self.live_bytes -= u.nbytes

    def fetch(self, units: list[ShardedUnit]) -> None:
        """Make ``units`` gathered (waiting for a prefetch in flight), then prefetch what comes next."""
        training = torch.is_grad_enabled() or _in_backward()
        for u in units:
            self.schedule.follow(u, training)
            self.ensure_gathered(u)
        upcoming = self.schedule.upcoming(training)
        self._read_ahead(upcoming)
        for pos in self.schedule.to_prefetch(upcoming, self.live_numel):
            self._read_ahead(upcoming[pos:])     # the reads after this one overlap its gather
            self.gather(upcoming[pos], async_op=True)

    def _read_ahead(self, upcoming: list[ShardedUnit]) -> None:
        """A store that is not resident starts reading the next shards while it has buffers free."""
        if self.store.resident:
            return
        for u in upcoming:
            if not u.gathered and not self.store.prefetch(u):
                break

    def invalidate(self) -> None:
        """Shards changed (optimizer step, checkpoint load): drop every gathered copy, persistent too, and
        wait until no copy up reads a host shard (the host rewrites them next)."""
        for u in self.units:
            if u.gathered:
                self.release(u)
            u.shard_readable()
        self.shards_changed()

    def shards_changed(self) -> None:
        """The shards were written (or are about to be) on the compute stream: the next gather orders after it."""
        self.shards_written = None

    def hold_all(self) -> list[ShardedUnit]:
        """Gather every unit not gathered and keep them all until `let_go`; the module hooks do nothing
        meanwhile (a generation: DeepSpeed's ``GatheredParameters`` over the model with its hooks removed, as TRL
        does). Returns the units gathered here."""
        opened = [u for u in self.units if self.ensure_gathered(u)]
        self.held = True
        return opened

    def let_go(self, opened: list[ShardedUnit]) -> None:
        """End `hold_all`: release the units it gathered."""
        self.held = False
        for u in opened:
            if u.gathered:
                self.release(u)

    def attach_root(self, model: torch.nn.Module) -> None:
        """Hook the root module: its forward restarts the evaluation trace, and is watched for stray reads
        while an order is recorded."""
        self.root = model
        # Never traced by torch.compile: dynamo breaks the graph here and runs the hooks eagerly (`compiling`).
        self.hooks.append(model.register_forward_pre_hook(torch.compiler.disable(self.root_pre_forward)))
        self.hooks.append(model.register_forward_hook(torch.compiler.disable(self.root_post_forward),
                                                      always_call=True))

    def root_pre_forward(self, module, args) -> None:
        """A forward without autograd starts at the root module: the evaluation trace restarts. While the
        forward's trace records, stray reads are watched (not under torch.compile, which would trace the mode)."""
        if self.held:
            return
        training = torch.is_grad_enabled() and not _in_backward()
        if not torch.is_grad_enabled():
            self.schedule.begin_eval_forward()
        if self.schedule.recording(training) and not any(is_compiled_module(m) for m in module.modules()):
            self.stray_reads.enter()

    def root_post_forward(self, module, args, output) -> None:
        self.stray_reads.leave()
        if not self.held and not torch.is_grad_enabled():
            self.schedule.end_eval_forward()

    def _on_stray(self, u: ShardedUnit) -> None:
        """``u``'s parameter is read in the root's forward outside its module's: fetch it now, and from the next
        forward on with the root module, whose order is recorded again."""
        self.busy += 1
        try:
            self.gather_check.before_forward([u], recording=True)
            if torch.is_grad_enabled() and not _in_backward():
                self.last_forward_use[u] = self.forward_fetches
                self.forward_fetches += 1
            self.fetch([u])
            self.forward_fetched.add(u)
            self.add_external(self.root, u)
            self.schedule.record_again()
        finally:
            self.busy -= 1

    def _pre_forward(self, module, args):
        if self.held:
            return
        units = self.module_units[module]
        self.busy += 1
        try:
            if self.stray_reads.active:
                self.forward_fetched.update(units)
            if not _in_backward():
                self.gather_check.before_forward(units, recording=self.schedule.recording(True))
            if torch.is_grad_enabled() and not _in_backward():
                for u in units:
                    self.last_forward_use[u] = self.forward_fetches
                    self.forward_fetches += 1
            self.fetch(units)
        finally:
            self.busy -= 1

    def _post_forward(self, module, args, output):
        if self.held or _in_backward():     # in backward: a recomputed forward, whose backward follows at once
            return output
        units = self.module_units[module]
        self.busy += 1
        try:
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(lambda grad, units=units: self._pre_backward(units, grad))
            for u in units:
                if not u.persistent and not self.schedule.reused_soon(u, self.live_numel):
                    self.release(u)
        finally:
            self.busy -= 1
        return output

    def _pre_backward(self, units: list[ShardedUnit], grad):
        """Backward reaches ``units``' module. Every unit before them in the fixed backward order that backward
        has not reached yet is passed over first (fetched and released): on this rank its output did not reach
        the loss, or not yet; on a rank where it did, backward fetched it at this point of the sequence. So
        every rank's sequence of gathers is the backward order, whatever each one's loss reads."""
        reached = [self.backward_position[u] for u in units if u in self.backward_position]
        if reached and max(reached) >= self.cursor:
            end = max(reached)
            for u in self.backward_order[self.cursor:end]:
                if u not in units:
                    self._pass_over(u)
            self.cursor = end + 1
        self.fetch(units)
        return grad

    def _pass_over(self, u: ShardedUnit) -> None:
        """Fetch ``u`` where the other ranks fetch it, and release it at once unless it is in use (persistent, or
        some of its gradients are in). Its reduce-scatter goes out in the fixed order: with zeros at the end of
        backward if no gradient of it ever arrives."""
        self.fetch([u])
        in_use = u.persistent or (not u.frozen and self.pending[u.index] not in (len(u.params), DONE))
        if u.gathered and not in_use:
            self.release(u)

    def begin_forward(self) -> None:
        """A training forward starts: the fetch order is recorded (first one) or replayed from here."""
        self.schedule.begin_micro_step()
        self.saved_params.start()
        self.last_forward_use.clear()
        self.forward_fetches = 0
        self.backward_order = []

    def begin_backward(self, first_micro_step: bool) -> None:
        """Backward starts: every trainable unit waits for all its gradients; ``first_micro_step`` of an
        accumulation overwrites the gradient partitions instead of adding."""
        self.first_micro_step = first_micro_step
        self.next_reduce = 0
        if self.last_forward_use:       # a second backward through the same forward keeps the order it had
            self.backward_order = sorted(self.last_forward_use, key=lambda u: -self.last_forward_use[u])
            self.last_forward_use.clear()
        self.backward_position = {u: i for i, u in enumerate(self.backward_order)}
        self.cursor = 0
        for partition in self.partitions:
            partition.begin_micro_step()
        for u in self.trainable:
            self.pending[u.index] = len(u.params)

    def end_backward(self) -> None:
        """After backward: units whose parameters got no gradient reduce zeros, all reduce-scatters are
        waited for, and every unit that is not persistent is released."""
        for index, left in self.pending.items():
            if left > 0:
                self.pending[index] = 0
        self._reduce_ready()
        self.in_flight.drain()
        self.saved_params.stop()
        for u in self.units:
            u.wait()
            if u.gathered and not u.persistent:
                self.release(u)

    @torch.no_grad()
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        u = self.unit_of[param]
        self.pending[u.index] -= 1
        if self.pending[u.index] == 0:
            self._reduce_ready()

    def _reduce_ready(self) -> None:
        """Launch, in the fixed order, every unit whose gradients are ready and whose predecessors went."""
        order = self.reduce_order
        while self.next_reduce < len(order) and self.pending[order[self.next_reduce].index] == 0:
            self._reduce(order[self.next_reduce])
            self.next_reduce += 1

    def _reduce(self, u: ShardedUnit) -> None:
        """Reduce-scatter the unit's gradient so each rank keeps its shard's, and release the unit."""
        self.pending[u.index] = DONE
        flat = u.flat_grad()
        if not u.persistent and u.gathered:
            self.release(u)
        self.in_flight.push((u, reduce_scatter_grad(self.reduce_ctx, flat, self.averaging, self.comm_dtype)))

    def _accumulate(self, item) -> None:
        u, reduction = item
        self.partitions[u.group].accumulate(u.partition_offset, finish(reduction), self.first_micro_step)
