"""Sharded units: one module's parameters of one param group, sharded 1/N across ranks.

ZeRO stage 3 (ZeRO paper, Sec. 5.3, P_os+g+p): every rank keeps only its 1/N shard of each unit's flat, padded 16-bit
parameters. A unit is all-gathered into a full buffer just before its module runs and released after; the parameters
are views into it, whose storage is freed on release and re-allocated on gather, so tensors autograd saved see the
gathered values again in backward (FSDP's flat parameters). While released, each parameter's ``.data`` is empty,
shape (0,), as in DeepSpeed: a read outside its module fails with a shape error, not on freed memory.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from zero_offload.comm import DistContext
from zero_offload.zero.flat import pack, partition_numel
from zero_offload.offload.copies import CopyHandle, Copies
from zero_offload.zero.stage3 import registry
from zero_offload.zero.stage3.swap import swap_keeping_attributes

__all__ = ["ShardedUnit", "GatherHandle", "units_by_module", "modules_owning"]


@dataclass
class GatherHandle:
    """An all-gather in flight: wait() before the unit's parameters are read. On CUDA the gather ran on the
    all-gather stream and ``event`` marks its end: waiting makes only the current (compute) stream wait for it.
    Elsewhere ``work`` is the collective's async handle."""
    work: object
    staging: torch.Tensor | None   # the device copy of a host shard, kept alive until the gather is done
    event: object = None
    copies: Copies | None = None   # CUDA, a host shard: its engine orders the staging's reuse after ``event``

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            if self.copies is not None:
                self.copies.uploads_read(self.event)
        elif self.work is not None:
            self.work.wait()


class ShardedUnit:
    """One module's trainable parameters of one param group as a sharded flat buffer.

    Attributes:
        full: (padded_numel,) training-dtype buffer on the compute device; its storage is empty while the
            unit is released. The parameters are views into it.
        shard: (shard_numel,) this rank's shard, a view into the group's partition (device memory, or host
            memory with ``offload_param``); bound by `bind`.
        persistent: numel <= ``stage3_param_persistence_threshold``: gathered once per step and kept.
        frozen: the parameters have ``requires_grad=False``: gathered for forward and backward, never reduced.
        partition_offset: where `shard` starts in the group's partition (set by `place`).
    """

    def __init__(self, index: int, group: int, module_name: str, params: list[torch.nn.Parameter],
                 names: list[str], indices: list[int], world_size: int, device: torch.device,
                 dtype: torch.dtype, persistence_threshold: int, frozen: bool = False):
        self.index, self.group, self.module_name, self.frozen = index, group, module_name, frozen
        self.params = params
        self.slots, self.numel, self.padded_numel = pack(params, indices, names, world_size)
        self.shard_numel = partition_numel([self.numel], world_size)
        self.full = torch.empty(self.padded_numel, dtype=dtype, device=device)
        self.nbytes = self.padded_numel * self.full.element_size()
        self.persistent = self.numel <= persistence_threshold
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self.full.untyped_storage().resize_(0)   # held only from `open` (materialising) or `gather` on
        self.gathered = False         # the full buffer holds valid values
        self.handle: GatherHandle | None = None
        self.shard: torch.Tensor | None = None
        self.partition_offset = 0
        self.copy_handle: CopyHandle | None = None   # the last copy up of a host shard
        self.gather_stream = None     # the CUDA stream ``full``'s memory was last allocated on (`_gather_on_stream`)

    def open(self) -> None:
        """Allocate ``full`` (zeroed) to materialise the unit: one unit at a time holds memory."""
        self.full.untyped_storage().resize_(self.nbytes)
        self.gather_stream = None
        self.full.zero_()
        self.gathered = True

    def attach_params(self) -> None:
        """Make every parameter a view into ``full`` (keeping the Parameter objects, so ties survive)."""
        for p, s in zip(self.params, self.slots):
            view = self.full[s.offset:s.end].view(s.shape)
            if p.is_meta:
                # Swap in a real tensor first; `.data = view` then gives the parameter the view's storage
                # but its own version counter, so gathering into `full` does not bump it.
                real = torch.nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                                          requires_grad=p.requires_grad)
                swap_keeping_attributes(p, real)
            else:
                view.copy_(p.data)
            p.data = view

    def param_at(self, offset: int, shape) -> torch.nn.Parameter | None:
        """The parameter whose view of ``full`` starts at element ``offset`` with ``shape``, or None."""
        for p, s in zip(self.params, self.slots):
            if s.offset == offset and tuple(s.shape) == tuple(shape):
                return p
        return None

    def place(self, partition_offset: int) -> int:
        """Put this unit's shard at ``partition_offset`` of its group's partition; returns where the next starts."""
        self.partition_offset = partition_offset
        return partition_offset + self.shard_numel

    def bind(self, shard: torch.Tensor, partition_offset: int, rank: int) -> None:
        """Give the unit its shard (a view of the group partition) and fill it from ``full``."""
        self.shard, self.partition_offset = shard, partition_offset
        shard.copy_(self.full[rank * self.shard_numel:(rank + 1) * self.shard_numel])

    def _point_params(self, at_full: bool) -> None:
        for p, s in zip(self.params, self.slots):
            p.data = self.full[s.offset:s.end].view(s.shape) if at_full else self._empty

    def gather(self, ctx: DistContext, copies: Copies, async_op: bool, stream=None,
               source: torch.Tensor | None = None, shards_written=None) -> GatherHandle | None:
        """Refill ``full`` from every rank's shard (a host shard is copied up first, on the copy stream).
        ``source`` stands in for `shard` (a swapped shard read into a store buffer; the caller waits with
        `shard_readable` before giving it back). With ``stream`` (CUDA's all-gather stream) see
        `_gather_on_stream`: the compute stream waits for the gather only in `wait`. ``shards_written``: the event
        recorded on the compute stream after the shards were last written there (the optimizer step, a load)."""
        src = self.shard if source is None else source
        self.gathered = True
        if stream is not None:
            self.handle = self._gather_on_stream(ctx, copies, stream, src, shards_written)
            if not async_op:
                self.wait()
            return self.handle
        self.full.untyped_storage().resize_(self.nbytes)
        self.gather_stream = None
        self._point_params(True)
        if src.device != self.full.device:
            staging = torch.empty(self.shard_numel, dtype=src.dtype, device=self.full.device)
            self.copy_handle = copies.to_device(staging, src)
            self.copy_handle.wait_stream()
            src = staging
        work = ctx.all_gather_into(self.full, src, async_op=async_op)   # one rank: a copy
        self.handle = GatherHandle(work, src) if async_op else None
        return self.handle

    def _gather_on_stream(self, ctx: DistContext, copies: Copies, stream, src: torch.Tensor,
                          shards_written) -> GatherHandle:
        """FSDP2's way: the full buffer is allocated on the all-gather stream and a host shard's staging copy on
        the copy stream, so neither waits for the compute queued so far. A buffer released earlier is reused
        in stream order (`release` makes this stream wait for the compute that read it), the host shard's copy
        is ordered by its event, and a device shard by ``shards_written``: a prefetch starts while earlier
        modules compute."""
        with torch.cuda.stream(stream):
            self.full.untyped_storage().resize_(self.nbytes)
        self.gather_stream = stream
        self._point_params(True)
        uploaded = src.device != self.full.device
        if uploaded:
            src, self.copy_handle = copies.upload(src)
            self.copy_handle.wait_stream(stream)
        elif shards_written is not None:
            stream.wait_event(shards_written)
        with torch.cuda.stream(stream):
            ctx.all_gather_into(self.full, src)   # one rank: a copy
            event = stream.record_event()
        if not uploaded:
            src.record_stream(stream)      # the shard itself: long-lived, nothing waits on its reuse
        return GatherHandle(None, src, event, copies if uploaded else None)

    def shard_readable(self) -> None:
        """Block until no copy up reads the host shard any more (before the host rewrites it)."""
        if self.copy_handle is not None:
            self.copy_handle.synchronize()
            self.copy_handle = None

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def release(self, keep_views: bool = False) -> None:
        """Free the full buffer's memory; the parameters keep their shapes but no storage. With ``keep_views`` the
        buffer's storage is left to the views of it that code may still hold (a ``p.data`` kept after
        ``GatheredParameters``: DeepSpeed's release leaves it valid too, and a view of storage resized to zero
        bytes would read freed memory), and ``full`` takes a storage of its own."""
        self.wait()
        if self.gather_stream is not None:
            # FSDP2's order, not record_stream: the gather stream waits for the compute that read the buffer, so
            # the allocator can hand its block to the next gather on that stream at once. record_stream would
            # keep it until the host sees that compute done, and a host running ahead would allocate anew.
            self.gather_stream.wait_stream(torch.cuda.current_stream())
        if keep_views:
            fresh = torch.empty(self.padded_numel, dtype=self.full.dtype, device=self.full.device)
            self.full.set_(fresh.untyped_storage(), 0, (self.padded_numel,))
        self.full.untyped_storage().resize_(0)
        self._point_params(False)
        self.gathered = False

    def flat_grad(self) -> torch.Tensor:
        """The unit's gradients packed in a padded flat buffer (zeros where a parameter got none); frees ``.grad``."""
        flat = torch.empty(self.padded_numel, dtype=self.full.dtype, device=self.full.device)
        if self.padded_numel > self.numel:
            flat[self.numel:].zero_()
        for p, s in zip(self.params, self.slots):
            if p.grad is None:
                flat[s.offset:s.end].zero_()
            else:
                flat[s.offset:s.end].copy_(p.grad.reshape(-1))
                p.grad = None
        return flat


def _inside_leaves(model: torch.nn.Module) -> set[int]:
    """ids of the modules below a leaf module (`registry.is_leaf`): they hold no unit and no hooks of their own."""
    inside: set[int] = set()
    for m in model.modules():
        if registry.is_leaf(m):
            inside.update(id(c) for c in m.modules() if c is not m)
    return inside


def _unit_modules(model: torch.nn.Module):
    """(name, module, its parameters) of each module that gathers for itself: a leaf module with every parameter
    below it (DeepSpeed's ``set_z3_leaf_modules``: one gather for a mixture-of-experts block whose forward may
    skip some experts), the others with their own."""
    inside = _inside_leaves(model)
    for name, module in model.named_modules():
        if id(module) not in inside:
            yield name, module, list(module.parameters(recurse=registry.is_leaf(module)))


def modules_owning(model: torch.nn.Module, wanted) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """(name, own parameters that ``wanted(p)`` selects) of every module that first holds some, in module order: a
    module owns a unit's worth of them, a tied parameter belonging to the first module that holds it; a leaf
    module owns everything below it (`_unit_modules`)."""
    seen: set[int] = set()
    out = []
    for name, module, params in _unit_modules(model):
        own = [p for p in params if wanted(p) and id(p) not in seen]
        if own:
            seen.update(id(p) for p in own)
            out.append((name, own))
    return out


def units_by_module(model: torch.nn.Module, units: list[ShardedUnit]) -> dict[torch.nn.Module, list[ShardedUnit]]:
    """Every module that holds a unit's parameter directly, with the units it needs gathered."""
    owner_of = {id(p): u for u in units for p in u.params}
    needs: dict[torch.nn.Module, list[ShardedUnit]] = defaultdict(list)
    for _, module, params in _unit_modules(model):
        external = registry.external_params(module)   # register_external_parameter
        for p in [*params, *external]:
            u = owner_of.get(id(p))
            if u is not None and u not in needs[module]:
                needs[module].append(u)
    return dict(needs)
