"""DeepSpeed's names over zero-offload's engine: a DeepSpeed script runs with one import changed.

    import zero_offload.deepspeed as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=model.parameters())

Mirrors ``deepspeed.initialize`` and friends of DeepSpeed 0.19.8. It is a thin layer: `initialize` builds
zero-offload's `Engine` (``zero_offload.initialize``) and wraps it in `DeepSpeedEngine`, DeepSpeed's
``nn.Module`` face. A client optimizer is turned into the config's ``optimizer`` section and param groups
(torch's Adam/AdamW run on the fused host kernel with their hyper-parameters; any other ``torch.optim``
optimizer runs on this rank's partition); a client scheduler is stepped with the engine's optimizer.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from zero_offload.compat import ops, zero
from zero_offload.compat.engine import DeepSpeedEngine
from zero_offload.compat.mpu import check_mpu
from zero_offload.compat.optimizer import ClientScheduler, client_optimizer_config
from zero_offload.comm import collective_timeout
from zero_offload.config import Config, ConfigError
from zero_offload.config.io import decode_config_string, read_config_file
from zero_offload.engine import Engine

__all__ = ["initialize", "add_config_arguments", "init_distributed", "zero", "ops", "DeepSpeedEngine"]

# ``from zero_offload.deepspeed.ops.adam import DeepSpeedCPUAdam``, as scripts import it from deepspeed.
sys.modules.setdefault(f"{__name__}.ops", ops)
sys.modules.setdefault(f"{__name__}.ops.adam", ops.adam)
sys.modules.setdefault(f"{__name__}.ops.lamb", ops.lamb)


def _raw_config(args, config, config_params) -> dict:
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ConfigError("a config was given both as args.deepspeed_config and as initialize(config=...); "
                              "give one (DeepSpeed refuses both too)")
        config = from_args
    if config is None:
        raise ConfigError("deepspeed.initialize needs a config: config=..., config_params=... or "
                          "args.deepspeed_config (--deepspeed_config)")
    if isinstance(config, Config):
        return config.to_dict()
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        if isinstance(config, str) and not os.path.exists(config):
            decoded = decode_config_string(config)
            if decoded is not None:
                return decoded
        return read_config_file(config)
    raise ConfigError(f"config must be a dict, a path or a base64 string, got {type(config).__name__}")


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Args:
        args: an object with ``deepspeed_config`` (a path), as ``add_config_arguments`` adds; optional.
        model: the ``nn.Module`` to train.
        optimizer: a ``torch.optim`` optimizer over the model's parameters, DeepSpeed's ``DeepSpeedCPUAdam`` or
            ``FusedLamb`` as `ops` names them, ``[torch.optim.Muon(matrices), torch.optim.AdamW(rest)]``
            (`compat.muon_client`), or a callable that takes the parameters and returns one; it
            replaces the config's ``optimizer`` section, as in DeepSpeed (`compat.optimizer`): Adam/AdamW
            run on the fused kernel (the host one with ``offload_optimizer``) with their param groups.
        model_parameters: parameters or param-group dicts (per-group lr / weight_decay are kept).
        training_data: a ``torch.utils.data.Dataset``; the returned loader has ``train_micro_batch_size_per_gpu``
            samples per batch and a ``DistributedSampler`` (DeepSpeed's dataloader).
        lr_scheduler: a torch scheduler (over ``optimizer`` or any optimizer with the same groups) or a callable
            taking the engine's optimizer; replaces the config's ``scheduler``.
        config, config_params: the config as a dict, a path (JSON or hjson) or a base64 string.

    Raises:
        ConfigError: no config or two configs, or an invalid config (the key is named).
        ValueError: ``model`` is None, ``mesh_param`` given or an ``mpu`` with model, pipeline or sequence
            parallelism (`compat.mpu.check_mpu`; an ``mpu`` of plain data parallelism is accepted), an
            optimizer that is neither a ``torch.optim`` one nor one of `ops`, or groups of a DeepSpeed class
            that differ in a key kept once per optimizer (``bias_correction``, Lamb's clamps).
    """
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mesh_param is not None:
        raise ValueError("deepspeed.initialize(mesh_param=...): model and sequence parallelism are not built in "
                         "zero-offload (data parallel only)")
    raw = _raw_config(args, config, config_params)
    init_distributed(dist_init_required=dist_init_required, distributed_port=distributed_port)
    if mpu is not None:
        check_mpu(mpu)
    auto_values: dict = {}
    if optimizer is not None:
        if callable(optimizer) and not isinstance(optimizer, (torch.optim.Optimizer, list, tuple)):
            params = model_parameters if model_parameters is not None else model.parameters()
            optimizer = optimizer(params)
        section, model_parameters = client_optimizer_config(optimizer, model)
        raw["optimizer"] = section
        auto_values = {f"optimizer.params.{k}": v for k, v in section["params"].items()}
    if lr_scheduler is not None:
        raw.pop("scheduler", None)
    engine = Engine(model, raw, model_parameters, auto_values=auto_values)
    if lr_scheduler is not None:
        if isinstance(lr_scheduler, Callable) and not hasattr(lr_scheduler, "step"):
            engine.lr_scheduler = lr_scheduler(engine.optimizer)
        else:
            engine.lr_scheduler = ClientScheduler(lr_scheduler, engine.optimizer)
    ds_engine = DeepSpeedEngine(engine)
    loader = None
    if training_data is not None:
        loader = deepspeed_dataloader(training_data, engine, collate_fn)
    return ds_engine, engine.optimizer, loader, engine.lr_scheduler


def deepspeed_dataloader(dataset, engine: Engine, collate_fn=None) -> torch.utils.data.DataLoader:
    """DeepSpeed's training dataloader: micro-batches of ``train_micro_batch_size_per_gpu`` from a
    ``DistributedSampler`` over the data-parallel ranks (shuffled, seed 0, as DeepSpeed's default sampler),
    dropping the last incomplete batch with ``dataloader_drop_last``."""
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.rank)
    return torch.utils.data.DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu,
                                       sampler=sampler, collate_fn=collate_fn,
                                       drop_last=engine.config.dataloader_drop_last)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed``, ``--deepspeed_config`` (and the deprecated ``--deepscale*``)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
_MPI_ENV = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),   # Open MPI
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))                                     # MPICH, Intel MPI


def _discover_environment(distributed_port: int) -> None:
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
    them: from an MPI launcher's variables (Open MPI's ``OMPI_COMM_WORLD_*``, MPICH's ``PMI_*``), else as a
    single process (rank 0 of 1, as mpi4py reports outside ``mpirun``), with ``MASTER_ADDR`` 127.0.0.1 and
    ``MASTER_PORT`` ``distributed_port``. So a script run as ``python train.py`` gets a one-rank group, as
    under DeepSpeed. That one-rank group is made over an in-process store: no port is bound (DeepSpeed binds
    ``MASTER_PORT``, so two such runs on one host collide there). Backend: ``dist_backend``, else NCCL with
    CUDA (bound to ``LOCAL_RANK``'s device), else gloo; ``timeout`` defaults to
    `zero_offload.comm.collective_timeout`. ``config`` and ``verbose`` are accepted and unused.

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
        _discover_environment(distributed_port)
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
