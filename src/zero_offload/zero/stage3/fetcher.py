"""Gathering stage-3 parameters just in time: module hooks, the recorded fetch order, and prefetch.

Before a module's forward its units are gathered; after it they are released unless persistent or reused
soon (``stage3_max_reuse_distance``). In backward, a hook on the module's outputs gathers them again before
the module's backward runs; they are released once their gradients have been reduce-scattered. The first
training micro-step records the order in which units are fetched; later ones replay it and gather up to
``stage3_prefetch_bucket_size`` elements ahead asynchronously (DeepSpeed's PartitionedParameterCoordinator).
If the order changes (data-dependent control flow), prefetching stops with one warning and every unit is
fetched on demand: the results stay exact.
"""
from __future__ import annotations

import warnings
from collections import defaultdict

import torch
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

from zero_offload.comm import DistContext
from zero_offload.offload.copies import Copies
from zero_offload.zero.stage3.partition_store import PartitionStore, ResidentStore
from zero_offload.zero.stage3 import registry
from zero_offload.zero.stage3.units import ShardedUnit

__all__ = ["ParameterFetcher"]

RECORDING, REPLAYING, ON_DEMAND = "recording", "replaying", "on-demand"


def _in_backward() -> bool:
    """True while autograd is running a backward pass (e.g. recomputing a checkpointed forward)."""
    return torch._C._current_graph_task_id() != -1


class ParameterFetcher:
    """Drives gather/release of the units through module hooks.

    Args:
        module_units: for every module that uses trainable parameters directly, the units holding them
            (a module whose weight is tied to another module's lists that module's unit too).
        prefetch_numel: elements gathered ahead of use (``stage3_prefetch_bucket_size``).
        max_live_numel: most elements gathered at once by prefetching (``stage3_max_live_parameters``).
        reuse_distance: keep a unit gathered if the trace uses it again within this many elements.
        store: where the shards live between gathers (default: resident in memory); a store that is not
            resident (NVMe) is read ahead in the recorded order and its buffer is taken back after each gather.
    """

    def __init__(self, ctx: DistContext, copies: Copies, units: list[ShardedUnit],
                 module_units: dict[torch.nn.Module, list[ShardedUnit]], prefetch_numel: int,
                 max_live_numel: int, reuse_distance: int, store: PartitionStore | None = None):
        self.ctx, self.copies, self.units = ctx, copies, units
        self.store = store if store is not None else ResidentStore()
        self.module_units = module_units
        self.prefetch_numel, self.max_live_numel = prefetch_numel, max_live_numel
        self.reuse_distance = reuse_distance
        self.mode = RECORDING
        self.trace: list[int] = []
        self.position = 0
        self.next_use: list[int] = []          # per trace position: elements fetched until the unit recurs
        self.last_position: dict[int, int] = {}   # unit index -> its latest position in the trace
        self.eval_mode, self.eval_trace, self.eval_position = RECORDING, [], 0   # no-autograd forwards
        self.live_numel = sum(u.padded_numel for u in units if u.gathered)   # the persistent ones
        self._live_bytes = sum(u.nbytes for u in units if u.gathered)
        # CUDA: all-gathers run on their own stream, so a prefetch never queues behind compute (FSDP2's way).
        self.gather_stream = torch.cuda.Stream(ctx.device) if ctx.device.type == "cuda" else None
        self.peak_live_bytes = 0               # the most gathered bytes at once, measured
        self.fetch_count = 0
        self.hooks = []
        for module in module_units:
            self.hooks.append(module.register_forward_pre_hook(self._pre_forward))
            self.hooks.append(module.register_forward_hook(self._post_forward))

    def add_external(self, module: torch.nn.Module, u: ShardedUnit) -> None:
        """Gather ``u`` before ``module``'s forward too (``register_external_parameter``)."""
        if module not in self.module_units:
            self.module_units[module] = []
            self.hooks.append(module.register_forward_pre_hook(self._pre_forward))
            self.hooks.append(module.register_forward_hook(self._post_forward))
        if u not in self.module_units[module]:
            self.module_units[module].append(u)

    # -- micro-step life cycle -------------------------------------------------------------------------
    def begin_micro_step(self) -> None:
        if self.mode == RECORDING and self.trace:
            self.mode = REPLAYING
            self._index_trace()
        self.position = 0
        self.last_position.clear()

    def end_micro_step(self) -> None:
        """After backward: release everything still gathered that is not persistent."""
        for u in self.units:
            u.wait()
            if u.gathered and not u.persistent:
                self.release(u)

    def invalidate(self) -> None:
        """Shards changed (optimizer step, checkpoint load): drop every gathered copy, persistent too."""
        for u in self.units:
            if u.gathered:
                self.release(u)
            u.shard_readable()

    # -- hooks -----------------------------------------------------------------------------------------
    def _pre_forward(self, module, args):
        self.fetch(self.module_units[module])

    def _post_forward(self, module, args, output):
        units = self.module_units[module]
        if _in_backward():
            return output           # a recomputed forward: its backward follows at once, keep the units
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(lambda grad, units=units: self._pre_backward(units, grad))
        for u in units:
            if not u.persistent and not self._reused_soon(u):
                self.release(u)
        return output

    def _pre_backward(self, units: list[ShardedUnit], grad):
        self.fetch(units)
        return grad

    # -- fetching --------------------------------------------------------------------------------------
    def fetch(self, units: list[ShardedUnit]) -> None:
        """Make ``units`` gathered (waiting for a prefetch in flight), then prefetch what comes next."""
        training = torch.is_grad_enabled() or _in_backward()
        for u in units:
            if training:
                self._follow_trace(u)
            else:
                self._follow_eval_trace(u)
            if u.gathered:
                u.wait()
                continue
            self.gather(u, async_op=False)
        if training and self.mode == REPLAYING:
            self._read_ahead(self.trace, self.position)
            self._prefetch(self.trace, self.position)
        elif not training and self.eval_mode == REPLAYING:
            self._read_ahead(self.eval_trace, self.eval_position)
            self._prefetch(self.eval_trace, self.eval_position)

    def begin_eval_forward(self) -> None:
        """A forward without autograd starts at the root module (evaluation, each token of ``generate()``):
        the first one is recorded, later ones replay its order so that they prefetch too."""
        if self.eval_mode == RECORDING and self.eval_trace:
            self.eval_mode = REPLAYING
        self.eval_position = 0

    def _follow_eval_trace(self, u: ShardedUnit) -> None:
        if self.eval_mode == RECORDING:
            self.eval_trace.append(u.index)
        elif self.eval_mode == REPLAYING:
            if self.eval_position < len(self.eval_trace) and self.eval_trace[self.eval_position] == u.index:
                self.eval_position += 1
            else:
                self.eval_mode = ON_DEMAND     # the order changed: fetch on demand, exact as ever

    def _follow_trace(self, u: ShardedUnit) -> None:
        if self.mode == RECORDING:
            self.trace.append(u.index)
        elif self.mode == REPLAYING:
            if self.position < len(self.trace) and self.trace[self.position] == u.index:
                self.last_position[u.index] = self.position
                self.position += 1
            else:
                warnings.warn("ZeRO stage 3: modules ran in a different order than in the first step "
                              "(data-dependent control flow); prefetching is off and parameters are "
                              "fetched on demand from now on", stacklevel=4)
                self.mode = ON_DEMAND

    def _prefetch(self, trace: list[int], position: int) -> None:
        ahead = 0
        for pos, idx in enumerate(trace[position:], position):
            u = self.units[idx]
            if ahead >= self.prefetch_numel:
                break
            ahead += u.numel
            if u.gathered:
                continue
            if self.live_numel + u.padded_numel > self.max_live_numel:
                break
            self._read_ahead(trace, pos)     # the reads after this one overlap its gather
            self.gather(u, async_op=True)

    def _read_ahead(self, trace: list[int], position: int) -> None:
        """A store that is not resident starts reading the next shards in the trace while buffers are free."""
        if self.store.resident:
            return
        for idx in trace[position:]:
            u = self.units[idx]
            if not u.gathered and not self.store.prefetch(u):
                break

    def gather(self, u: ShardedUnit, async_op: bool = False) -> None:
        """All-gather unit ``u`` into its full buffer now (``async_op``: in flight until `ShardedUnit.wait`),
        out of the recorded order: nothing is traced or prefetched."""
        swapped = not self.store.resident
        if swapped:
            kept, u.shard = u.shard, self.store.acquire(u)
        with record_function("zero_offload.stage3.gather"):
            # A swapped shard's buffer goes back to the store right after: its gather cannot stay in flight.
            u.gather(self.ctx, self.copies, async_op and not swapped, self.gather_stream)
        if swapped:
            u.shard_readable()
            self.store.release(u)
            u.shard = kept
        self.fetch_count += 1
        self.live_numel += u.padded_numel
        self._live_bytes += u.nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes())

    def release(self, u: ShardedUnit) -> None:
        u.release()
        self.live_numel -= u.padded_numel
        self._live_bytes -= u.nbytes

    def live_bytes(self) -> int:
        """Bytes of full buffers gathered right now (kept as a running count: O(1))."""
        return self._live_bytes

    # -- reuse distance --------------------------------------------------------------------------------
    def _index_trace(self) -> None:
        """For each trace position, the elements fetched before the same unit is fetched again."""
        last: dict[int, int] = {}
        fetched = [0]
        for idx in self.trace:
            fetched.append(fetched[-1] + self.units[idx].numel)
        self.next_use = [1 << 62] * len(self.trace)
        for pos in range(len(self.trace) - 1, -1, -1):
            idx = self.trace[pos]
            if idx in last:
                self.next_use[pos] = fetched[last[idx]] - fetched[pos + 1]
            last[idx] = pos

    def _reused_soon(self, u: ShardedUnit) -> bool:
        pos = self.last_position.get(u.index)
        if self.mode != REPLAYING or pos is None or self.reuse_distance <= 0:
            return False
        return self.next_use[pos] <= self.reuse_distance and self.live_numel <= self.max_live_numel


def units_by_module(model: torch.nn.Module, units: list[ShardedUnit]) -> dict[torch.nn.Module, list[ShardedUnit]]:
    """Every module that holds a unit's parameter directly, with the units it needs gathered."""
    owner_of = {id(p): u for u in units for p in u.params}
    needs: dict[torch.nn.Module, list[ShardedUnit]] = defaultdict(list)
    for module in model.modules():
        external = registry.external_params(module)   # register_external_parameter
        for p in [*module.parameters(recurse=False), *external]:
            u = owner_of.get(id(p))
            if u is not None and u not in needs[module]:
                needs[module].append(u)
    return dict(needs)
