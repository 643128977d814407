"""``deepspeed.comm.comm``: DeepSpeed 0.19.8's communication functions over torch.distributed.

Each collective takes DeepSpeed's signature (``prof``, ``log_name`` and ``debug`` are accepted and unused: no
comms logger) and runs torch's through `zero_offload.comm.passthrough.torch_collective`, so CPU tensors are handed over to
gloo as the engine's own are. DeepSpeed's `ReduceOp` is its own enum; it is mapped onto torch's by name.
`init_distributed` makes the default group as DeepSpeed's does (launcher variables, else MPI's, else one rank).
"""
from __future__ import annotations

import os
from enum import Enum

import torch
import torch.distributed as dist

from zero_offload import comm as zo_comm
from zero_offload.comm import collective_timeout
from zero_offload.comm.passthrough import torch_collective

__all__ = ["ReduceOp", "ProcessGroup", "init_distributed", "is_initialized", "is_available", "destroy_process_group",
           "new_group", "get_rank", "get_world_size", "get_local_rank", "get_global_rank", "get_world_group",
           "get_all_ranks_from_group", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
           "all_reduce", "inference_all_reduce", "reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
           "allgather_fn", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn", "all_to_all_single",
           "all_to_all", "send", "recv", "isend", "irecv", "gather", "scatter", "P2POp", "batch_isend_irecv",
           "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "has_coalescing_manager",
           "has_all_reduce_coalesced", "configure", "log_summary", "reset_log", "get_backend", "mpi_discovery"]


class ReduceOp(Enum):
    """DeepSpeed's ``deepspeed.comm.ReduceOp`` (its values)."""
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


ProcessGroup = dist.ProcessGroup


def _op(op):
    """DeepSpeed's or torch's reduce op, as torch's."""
    return getattr(dist.ReduceOp, op.name) if isinstance(op, ReduceOp) else op


# -- the group ---------------------------------------------------------------------------------------------
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
_MPI_ENV = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),   # Open MPI
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))                                     # MPICH, Intel MPI


def mpi_discovery(distributed_port: int = 29500, verbose: bool = True) -> None:
    """DeepSpeed's ``mpi_discovery`` without mpi4py: the rank, size and local rank an MPI launcher exported,
    else a single process (rank 0 of 1); then ``MASTER_ADDR`` (127.0.0.1) and ``MASTER_PORT``
    (``distributed_port``) where unset. Variables already set are kept."""
    for rank_key, size_key, local_key in _MPI_ENV:
        if rank_key in os.environ and size_key in os.environ:
            found = (os.environ[rank_key], os.environ[size_key], os.environ.get(local_key, os.environ[rank_key]))
            break
    else:
        found = ("0", "1", "0")
    for key, value in zip(("RANK", "WORLD_SIZE", "LOCAL_RANK"), found):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout=None, init_method=None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """DeepSpeed 0.19.8's ``deepspeed.comm.init_distributed``: create the default process group unless one
    exists, so a script may call ``torch.distributed.get_rank()``, ``get_world_size()`` and ``barrier()``.

    Where the launcher variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``)
    are not all set and ``auto_mpi_discovery`` is true, they are filled as DeepSpeed's MPI discovery fills
    them (`mpi_discovery`). So a script run as ``python train.py`` gets a one-rank group, as under DeepSpeed.
    That one-rank group is made over an in-process store: no port is bound (DeepSpeed binds ``MASTER_PORT``,
    so two such runs on one host collide there). Backend: ``dist_backend``, else NCCL with CUDA (bound to
    ``LOCAL_RANK``'s device), else gloo; ``timeout`` defaults to `zero_offload.comm.collective_timeout`.
    ``config`` and ``verbose`` are accepted and unused.

    Raises:
        RuntimeError: ``dist_init_required=False`` and no process group exists (DeepSpeed asserts the same);
            ``WORLD_SIZE`` > 1 set by hand with no ``RANK`` (the message names the missing variables).
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("init_distributed(dist_init_required=False): no process group is initialized; set "
                           "dist_init_required=True (or leave it None) or create the group before (DeepSpeed "
                           "asserts the same)")
    if rank >= 0 and world_size > 0:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    elif auto_mpi_discovery and not all(k in os.environ for k in _LAUNCHER_ENV):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" not in os.environ:
            raise RuntimeError(f"init_distributed: WORLD_SIZE={os.environ['WORLD_SIZE']} is set but RANK is not "
                               f"(launch with torchrun, or set RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
        mpi_discovery(distributed_port)
    cuda = torch.cuda.is_available()
    backend = dist_backend or ("nccl" if cuda else "gloo")
    kwargs = {"timeout": collective_timeout() if timeout is None else timeout}
    if backend == "nccl" and cuda:
        # DeepSpeed binds the group to LOCAL_RANK's device and its engine then sets that device current.
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(kwargs["device_id"])
    if rank >= 0 and world_size > 0:
        kwargs.update(rank=rank, world_size=world_size)
    elif init_method is None and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, init_method=init_method, **kwargs)


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks):
    return dist.new_group(ranks)


def get_backend(group=None) -> str:
    return dist.get_backend(group)


def get_world_size(group=None) -> int:
    """Ranks in ``group`` (the default group when None); 1 before any group exists, as DeepSpeed's."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_rank(group=None) -> int:
    """This process's rank in ``group``; 0 before any group exists (DeepSpeed's TorchBackend answers -1 there only
    when torch.distributed is unavailable)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_local_rank() -> int:
    """``LOCAL_RANK`` from the launcher's environment (DeepSpeed asserts it is set; 0 here when it is not)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group():
    return dist.group.WORLD


def get_all_ranks_from_group(group=None) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(get_world_size()))


# -- the collectives -----------------------------------------------------------------------------------------
def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier", debug=None):
    return torch_collective("barrier")(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False, prof=False, log_name="monitored_barrier",
                      debug=None):
    return torch_collective("monitored_barrier")(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None):
    return torch_collective("broadcast")(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list, src, group=None, device=None, prof=False, log_name="broadcast_object_list",
                          debug=None) -> None:
    """In place, as torch's; by pickled byte tensors the engine holds (`zero_offload.comm.broadcast_object`)."""
    object_list[:] = zo_comm.broadcast_object(list(object_list), src, group)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce",
               debug=None):
    return torch_collective("all_reduce")(tensor, op=_op(op), group=group, async_op=async_op)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None, prof=False, log_name="all_reduce", debug=None):
    return all_reduce(tensor, op, group)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce", debug=None):
    return torch_collective("reduce")(tensor, dst, op=_op(op), group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None):
    return torch_collective("all_gather")(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None, prof=False, log_name="all_gather_object", debug=None) -> None:
    """In place, as torch's; by pickled byte tensors the engine holds (`zero_offload.comm.gather_objects`)."""
    object_list[:] = zo_comm.gather_objects(obj, group)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, prof=False,
                           log_name="all_gather_into_tensor", debug=None):
    return zo_comm.all_gather_into(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                          log_name="reduce_scatter_tensor", debug=None):
    return torch_collective("reduce_scatter_tensor")(output_tensor, tensor, op=_op(op), group=group,
                                                             async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op, group, async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                   log_name="reduce_scatter", debug=None):
    return torch_collective("reduce_scatter")(output, input_list, op=_op(op), group=group, async_op=async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
                      prof=False, log_name="all_to_all_single", debug=None):
    return torch_collective("all_to_all_single")(output, tensor, output_split_sizes, input_split_sizes,
                                                         group=group, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, prof=False, log_name="all_to_all",
               debug=None):
    return torch_collective("all_to_all")(output_tensor_list, input_tensor_list, group=group,
                                                  async_op=async_op)


def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    return torch_collective("send")(tensor, dst, group=group, tag=tag)


def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    return torch_collective("recv")(tensor, src, group=group, tag=tag)


def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    return torch_collective("isend")(tensor, dst, group=group, tag=tag)


def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    return torch_collective("irecv")(tensor, src, group=group, tag=tag)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, prof=False, log_name="gather", debug=None):
    return torch_collective("gather")(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, prof=False, log_name="scatter",
            debug=None):
    return torch_collective("scatter")(tensor, scatter_list, src, group=group, async_op=async_op)


P2POp = dist.P2POp


def batch_isend_irecv(p2p_op_list, prof=False, log_name="batch_isend_irecv", debug=None):
    return torch_collective("batch_isend_irecv")(p2p_op_list)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


def has_all_reduce_coalesced() -> bool:
    return False


# -- DeepSpeed's comms logger: accepted, nothing logged ------------------------------------------------------
def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None) -> None:
    """DeepSpeed's comms-logger switch; zero-offload keeps no comms log (`zero_offload.runtime.stats` counts what a step
    moved), so this changes nothing."""


def log_summary(show_straggler=False, return_dict=False):
    return {} if return_dict else None


def reset_log() -> None:
    """Nothing is logged, so nothing to reset."""
