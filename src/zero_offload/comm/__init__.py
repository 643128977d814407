"""Process groups and the collectives ZeRO needs, with async handles.

`DistContext.create()` uses the default process group when one exists; otherwise it creates one from the
torchrun environment (NCCL on CUDA, gloo on CPU); with no such environment it is a single rank and no
collective is ever issued. Either way a CUDA rank computes on ``cuda:LOCAL_RANK`` when the launcher set it
(`choose_device`), and CPU tensors given to the module-level collectives under an NCCL-only group go through
that device (`collective_device`).

With ``ZERO_OFFLOAD_SIMULATE_STREAMS=1`` on the CPU, every asynchronous collective's result (and at one rank, its
identity copy) lands in the output later, on a worker thread (`zero_offload.offload.simulated`): a read before
the handle's ``wait`` sees stale bytes, as with NCCL on a GPU.
"""
from __future__ import annotations

import functools
import os
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zero_offload.comm.devices import choose_device, device_free_bytes
from zero_offload.comm.handover import handed, settle
from zero_offload.offload import simulated
from zero_offload.offload.simulated import SimulatedCollectives

__all__ = ["DistContext", "DoneWork", "CollectiveTimeoutError", "collective_timeout", "deadline", "all_gather_into",
           "reduce_scatter", "all_to_all", "all_reduce_sum", "broadcast", "gather_objects", "broadcast_object",
           "barrier", "collective_device", "choose_device", "device_free_bytes"]

DEFAULT_TIMEOUT_S = 600.0   # 10 minutes: long enough for a slow checkpoint, short enough to notice a stall


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete in time on this rank: another rank stalled, died, or issued different
    collectives. The message names this rank and the deadline."""


def collective_timeout() -> timedelta:
    """The deadline of every collective: ``ZERO_OFFLOAD_TIMEOUT_S`` (seconds), else DeepSpeed's
    ``DEEPSPEED_TIMEOUT`` (minutes), else 10 minutes. Applies to process groups that `DistContext.create`
    creates (a group created by the caller keeps its own timeout).

    Raises:
        ValueError: a variable that is not a positive number (names it).
    """
    for name, unit in (("ZERO_OFFLOAD_TIMEOUT_S", 1.0), ("DEEPSPEED_TIMEOUT", 60.0)):
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not value > 0:
                raise ValueError(f"environment variable {name}={raw!r} must be a positive number of "
                                 f"{'seconds' if unit == 1.0 else 'minutes'}")
            return timedelta(seconds=value * unit)
    return timedelta(seconds=DEFAULT_TIMEOUT_S)


_COMM_FAILURES = ("timed out", "timeout", "connection closed by peer", "connection reset by peer",
                  "broken pipe", "watchdog")


def _is_comm_failure(e: BaseException) -> bool:
    if isinstance(e, CollectiveTimeoutError):
        return False
    dist_error = getattr(dist, "DistError", ())
    text = str(e).lower()
    return (isinstance(e, dist_error) or isinstance(e, RuntimeError)) and any(k in text for k in _COMM_FAILURES)


def deadline(method):
    """Decorate a method of an object with a ``ctx`` (`DistContext`): a collective that fails by timeout or a
    lost peer inside it becomes a `CollectiveTimeoutError` naming this rank and the deadline."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as e:
            ctx = self.ctx
            if not ctx.distributed or not _is_comm_failure(e):
                raise
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            limit = f"{ctx.timeout.total_seconds():g} s" if ctx.timeout is not None else \
                "the process group's timeout"
            raise CollectiveTimeoutError(
                f"rank {ctx.rank} of {ctx.world_size}: a collective in {method.__name__}() did not complete "
                f"within {limit} (set by ZERO_OFFLOAD_TIMEOUT_S in seconds or DEEPSPEED_TIMEOUT in minutes); "
                f"another rank is stalled, has died, or issued different collectives ({first})") from e
    return wrapper


# torch 2.13 deprecates the ``*_tensor`` names for ``*_single``; torch 2.4 has only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collective_device(tensor: torch.Tensor, group=None) -> torch.device:
    """Where a collective on ``tensor`` runs for ``group``'s backend: the tensor's own device, except a CPU
    tensor under a group with no CPU backend (NCCL only, as `DistContext.create` and torchrun scripts make on
    GPUs): then this process's current CUDA device. A ``cpu:gloo,cuda:nccl`` group takes CPU tensors as they are.
    FSDP2 and DeepSpeed's ``zero.Init`` likewise move what they broadcast at init to the accelerator."""
    if tensor.device.type != "cpu" or not dist.is_initialized():
        return tensor.device
    backend = str(dist.get_backend(group)).lower()
    if any(name in backend for name in ("gloo", "mpi", "cpu:")):
        return tensor.device
    return torch.device("cuda", torch.cuda.current_device())


def _on(device: torch.device, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.device == device else t.to(device) for t in tensors]


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Fill ``out`` (world_size x ``inp.numel()`` elements) with every rank's ``inp``, in rank order. CPU tensors
    under an NCCL-only group go through the current CUDA device (`collective_device`; then synchronously, and an
    ``async_op`` handle is already done)."""
    device = collective_device(out, group)
    if device == out.device:
        return _ALL_GATHER(*handed(out, inp), group=group, async_op=async_op)
    staged_out, staged_in = _on(device, [out, inp])
    _ALL_GATHER(staged_out, staged_in, group=group)
    out.copy_(staged_out)
    return DoneWork() if async_op else None


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, average: bool = False, group=None, async_op: bool = True):
    """Sum (``average``: NCCL's ReduceOp.AVG) ``inp`` over ranks and keep this rank's slice of it in ``out``."""
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    return _REDUCE_SCATTER(*handed(out, inp), op=op, group=group, async_op=async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group=None) -> None:
    """Send ``in_splits[r]`` consecutive elements of ``inp`` to rank r and receive ``out_splits[r]`` from it into
    ``out``, in rank order (synchronous). CPU tensors under an NCCL-only group go through the current CUDA device
    (`collective_device`)."""
    device = collective_device(out, group)
    if device == out.device:
        dist.all_to_all_single(*handed(out, inp), out_splits, in_splits, group=group)
        return
    staged_out, staged_in = _on(device, [out, inp])
    dist.all_to_all_single(staged_out, staged_in, out_splits, in_splits, group=group)
    out.copy_(staged_out)


def all_reduce_sum(tensor: torch.Tensor, group=None) -> None:
    """Sum ``tensor`` over ``group``'s ranks in place (synchronous; nothing on a single process). A CPU tensor under
    an NCCL-only group goes through the current CUDA device (`collective_device`)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    device = collective_device(tensor, group)
    if device == tensor.device:
        dist.all_reduce(*handed(tensor), group=group)
        return
    staged = tensor.to(device)
    dist.all_reduce(staged, group=group)
    tensor.copy_(staged)


def broadcast(tensor: torch.Tensor, src: int, group=None) -> None:
    """Give every rank global rank ``src``'s values of ``tensor`` (a CPU tensor under an NCCL-only group goes
    through the current CUDA device: `collective_device`)."""
    device = collective_device(tensor, group)
    if device == tensor.device:
        dist.broadcast(*handed(tensor), src=src, group=group)
        return
    staged = tensor.to(device)
    dist.broadcast(staged, src=src, group=group)
    tensor.copy_(staged)


def _pickled(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def gather_objects(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` on a single process). Pickled into byte tensors,
    as ``torch.distributed.all_gather_object`` does, but gathered by `all_gather_into`, so that the backend
    never frees them at exit (`zero_offload.comm.handover`)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    data, sizes = _pickled(obj), torch.zeros(dist.get_world_size(group), dtype=torch.int64)
    all_gather_into(sizes, torch.tensor([data.numel()]), group)
    rows = torch.empty(len(sizes), int(sizes.max()), dtype=torch.uint8)
    all_gather_into(rows.view(-1), torch.cat([data, rows.new_zeros(rows.shape[1] - data.numel())]), group)
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(sizes.tolist())]


def broadcast_object(obj, src: int = 0, group=None):
    """Global rank ``src``'s picklable ``obj``, on every rank (``src`` keeps its own object), by `broadcast`
    of its pickled bytes, as ``torch.distributed.broadcast_object_list`` does."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    mine = dist.get_rank() == src
    data = _pickled(obj) if mine else None
    size = torch.tensor([data.numel() if mine else 0])
    broadcast(size, src, group)
    data = data if mine else torch.empty(int(size), dtype=torch.uint8)
    broadcast(data, src, group)
    return obj if mine else pickle.loads(data.numpy().tobytes())


def barrier(group=None) -> None:
    """Wait for every rank (nothing on a single process)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


class DoneWork:
    """The handle of a collective that had nothing to do (world size 1)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass
class DistContext:
    """This process's place among the data-parallel ranks and its compute device."""
    rank: int
    world_size: int
    device: torch.device
    group: object = None  # the data-parallel process group; None means the default group
    timeout: timedelta | None = None   # the collectives' deadline, when this process created the group
    # ZERO_OFFLOAD_SIMULATE_STREAMS: async collectives land later (`zero_offload.offload.simulated`); None: off
    simulation: SimulatedCollectives | None = None
    owns_group: bool = False           # made by `for_reductions`: `close` destroys it

    @classmethod
    def create(cls) -> "DistContext":
        """Join (or create) the data-parallel group; see the module docstring.

        A group created here gets the deadline of `collective_timeout`.

        Raises:
            RuntimeError: the torchrun environment is incomplete (names the missing variables).
            ValueError: a bad ``ZERO_OFFLOAD_TIMEOUT_S`` or ``DEEPSPEED_TIMEOUT``.
        """
        cuda = torch.cuda.is_available()
        timeout = None
        if not dist.is_initialized() and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {', '.join(missing)} "
                                   f"is not: launch with torchrun or set the process-group environment")
            timeout = collective_timeout()
            if cuda:
                # Bind the group to this rank's GPU up front (eager NCCL init, no device guessing later).
                local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
                torch.cuda.set_device(local)
                # A timed-out NCCL collective then aborts the communicator instead of blocking forever.
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
                dist.init_process_group("nccl", device_id=local, timeout=timeout)
            else:
                dist.init_process_group("gloo", timeout=timeout)
        if dist.is_initialized():
            rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        else:
            rank, world, backend = 0, 1, None
        device = choose_device(backend, cuda)
        if device.type == "cuda":
            torch.cuda.set_device(device)      # a group the user created binds LOCAL_RANK's GPU too
        simulation = SimulatedCollectives() if simulated.enabled() and device.type == "cpu" else None
        return cls(rank, world, device, timeout=timeout, simulation=simulation)

    def broadcast_from_first(self, tensors) -> None:
        """Give every rank rank 0's values (the initial weights, as DeepSpeed's _broadcast_model)."""
        if self.distributed:
            for t in tensors:
                broadcast(t, self._global(0), self.group)

    def broadcast_from(self, tensor: torch.Tensor, rank: int) -> None:
        """Give every rank ``rank``'s (a rank within the group) values of ``tensor``."""
        if self.distributed:
            broadcast(tensor, self._global(rank), self.group)

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Fill ``out`` with every rank's ``inp`` in rank order (a copy on one rank); the work handle, or None
        when ``async_op`` is False."""
        if async_op and self.simulation is not None:
            launch = (lambda o: all_gather_into(o, inp, self.group, True)) if self.distributed else None
            return self.simulation.into(out, launch, inp)
        if not self.distributed:
            out.copy_(inp)
            return DoneWork() if async_op else None
        return all_gather_into(out, inp, self.group, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, average: bool = False, async_op: bool = True):
        """This rank's slice of ``inp`` summed (or averaged, see `native_average`) over ranks, into ``out``."""
        if async_op and self.simulation is not None:
            launch = (lambda o: reduce_scatter(o, inp, average, self.group, True)) if self.distributed else None
            return self.simulation.into(out, launch, inp)
        if not self.distributed:
            out.copy_(inp)
            return DoneWork()
        return reduce_scatter(out, inp, average, self.group, async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        """Each rank sends ``in_splits[r]`` elements of ``inp`` to rank r (of the group) and receives
        ``out_splits[r]`` into ``out``, in rank order; synchronous (Muon's owners:
        `zero_offload.hoststep.muon_owners`).
        """
        if not self.distributed:
            out.copy_(inp)
            return
        all_to_all(out, inp, out_splits, in_splits, self.group)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def reduce(self, tensor: torch.Tensor, owner: int, async_op: bool = True, average: bool = False):
        """Sum (or with ``average``, average: NCCL's ReduceOp.AVG, see `native_average`) ``tensor`` over
        ranks into ``owner``'s copy (the bucketed reduce-scatter's per-owner part)."""
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        if async_op and self.simulation is not None:
            dst = self._global(owner)
            launch = ((lambda t: dist.reduce(*handed(t), dst=dst, op=op, group=self.group, async_op=True))
                      if self.distributed else None)
            return self.simulation.in_place(tensor, launch, receives=owner == self.rank)
        if not self.distributed:
            return DoneWork()
        return dist.reduce(*handed(tensor), dst=self._global(owner), op=op, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = True, average: bool = False):
        """Sum (or with ``average``, average) ``tensor`` over ranks in place, on every rank."""
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        if async_op and self.simulation is not None:
            launch = ((lambda t: dist.all_reduce(*handed(t), op=op, group=self.group, async_op=True))
                      if self.distributed else None)
            return self.simulation.in_place(tensor, launch)
        if not self.distributed:
            return DoneWork()
        return dist.all_reduce(*handed(tensor), op=op, group=self.group, async_op=async_op)

    def native_average(self, dtype: torch.dtype) -> bool:
        """True when the backend averages in the collective itself (NCCL's ReduceOp.AVG), so no separate
        division kernel is needed; fp16 keeps dividing first to stay in range, and gloo has no AVG."""
        return self.distributed and dtype != torch.float16 and dist.get_backend(self.group) == "nccl"

    def all_gather_partitions(self, flat: torch.Tensor, partition_numel: int, bucket_numel: int) -> None:
        """Fill every rank's partition of ``flat`` from its owner, ``bucket_numel`` elements per collective.

        ``flat`` holds ``world_size`` contiguous partitions of ``partition_numel`` elements; this rank's
        partition is the input.
        """
        if not self.distributed:
            return
        parts = flat.view(self.world_size, partition_numel)
        if bucket_numel >= partition_numel:
            all_gather_into(flat, parts[self.rank], self.group)
            return
        for lo in range(0, partition_numel, bucket_numel):
            hi = min(lo + bucket_numel, partition_numel)
            *views, mine = handed(*parts[:, lo:hi].unbind(0), parts[self.rank, lo:hi].clone())
            dist.all_gather(views, mine, group=self.group)

    def for_reductions(self) -> "DistContext":
        """A context over the same ranks on a process group of its own (made now: a collective call that every
        rank of the default group makes), for stage 3's reduce-scatters, so that their order is checked against
        each other only and never against the all-gathers. A unit whose gradients reach the loss on some ranks
        only is reduced there during backward and elsewhere at its end; on one group that reordered the two
        kinds of collective differently on each rank, and the ranks hung. One rank: this context itself.
        `close` destroys the group."""
        if not self.distributed:
            return self
        ranks = [self._global(r) for r in range(self.world_size)]
        group = dist.new_group(ranks, timeout=self.timeout) if self.timeout else dist.new_group(ranks)
        return DistContext(self.rank, self.world_size, self.device, group, self.timeout,
                           SimulatedCollectives() if self.simulation is not None else None, owns_group=True)

    def close(self) -> None:
        """Land the simulated collectives queued and end their thread (from `Engine.close`), and wait until the
        backend has let go of every tensor given to a collective (`zero_offload.comm.handover`). A group made by
        `for_reductions` is destroyed; the data-parallel group stays: whoever created it destroys it
        (``dist.destroy_process_group``), as with DeepSpeed's engine."""
        if self.simulation is not None:
            self.simulation.close()
        settle()
        if self.owns_group and dist.is_initialized():
            self.owns_group = False
            dist.destroy_process_group(self.group)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)
