"""DeepSpeed's face over zero-offload's engine: a DeepSpeed script runs with one import changed, or none.

    import zero_offload.deepspeed as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=model.parameters())

Under ``zero-offload run -- CMD`` (or ``ZERO_OFFLOAD_AS_DEEPSPEED=1``) this package *is* ``deepspeed``
(`zero_offload_stand_in`): its submodules carry DeepSpeed's module names (``deepspeed.comm``,
``deepspeed.accelerator``, ``deepspeed.runtime.zero.partition_parameters``, ``deepspeed.utils``, ...), each a thin
layer over the engine; what is not built (pipeline, tensor and expert parallelism, compression, inference)
imports, and fails when used (`zero_offload.compat.unbuilt`).

Mirrors ``deepspeed.initialize`` and friends of DeepSpeed 0.19.8. It is a thin layer: `initialize` builds
zero-offload's `Engine` (``zero_offload.initialize``) and wraps it in `DeepSpeedEngine`, DeepSpeed's
``nn.Module`` face. A client optimizer is turned into the config's ``optimizer`` section and param groups
(torch's Adam/AdamW run on the fused host kernel with their hyper-parameters; any other ``torch.optim``
optimizer runs on this rank's partition); a client scheduler is stepped with the engine's optimizer.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch

from zero_offload.compat import param_state
from zero_offload.compat.engine import DeepSpeedEngine, FrozenDeepSpeedEngine
from zero_offload.compat.mpu import check_mpu
from zero_offload.compat.optimizer import ClientScheduler, client_optimizer_config
from zero_offload.compat.optimizer_face import DeepSpeedOptimizer
from zero_offload.compat.unbuilt import INSTEAD, unbuilt
from zero_offload.config import Config, ConfigError
from zero_offload.config.io import decode_config_string, read_config_file
from zero_offload.deepspeed import accelerator, checkpoint, comm, ops, runtime, utils
from zero_offload.deepspeed.accelerator import get_accelerator
from zero_offload.deepspeed.comm import init_distributed
from zero_offload.deepspeed.runtime import zero
from zero_offload.deepspeed.runtime.activation_checkpointing import checkpointing
from zero_offload.deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from zero_offload.deepspeed.runtime.dataloader import DeepSpeedDataLoader
from zero_offload.deepspeed.utils import OnDevice, log_dist, logger
from zero_offload.engine import Engine
from zero_offload_stand_in import deepspeed_version

__all__ = ["initialize", "add_config_arguments", "init_distributed", "zero", "ops", "comm", "accelerator",
           "checkpoint", "checkpointing", "runtime", "utils", "DeepSpeedEngine", "DeepSpeedOptimizer",
           "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedDataLoader", "get_accelerator", "logger",
           "log_dist", "OnDevice", "init_inference", "tp_model_init", "PipelineModule", "PipelineEngine",
           "InferenceEngine", "DeepSpeedHybridEngine", "__version__", "version"]

__version__ = version = deepspeed_version()     # "0.19.8+zo<ours>": the DeepSpeed whose behaviour is mirrored
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in version.split("+")[0].split("."))
__git_hash__ = git_hash = None
__git_branch__ = git_branch = None

PipelineModule = unbuilt("deepspeed.pipe.PipelineModule", INSTEAD["pipeline"])
PipelineEngine = unbuilt("deepspeed.runtime.pipe.engine.PipelineEngine", INSTEAD["pipeline"])
InferenceEngine = unbuilt("deepspeed.inference.engine.InferenceEngine", INSTEAD["inference"])
DeepSpeedHybridEngine = unbuilt("deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine", INSTEAD["hybrid"])
init_inference = unbuilt("deepspeed.init_inference", INSTEAD["inference"])
tp_model_init = unbuilt("deepspeed.tp_model_init", INSTEAD["tensor"])


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
        ConfigError: no config or two configs, an invalid config (the key is named), or no optimizer at ZeRO
            stage 1 or 2 (DeepSpeed asserts the same; with no optimizer at stage 0 or 3 the engine is a frozen
            model, `FrozenDeepSpeedEngine`, and the returned optimizer is None).
        ValueError: ``model`` is None, ``mesh_param`` given or an ``mpu`` with model or pipeline parallelism
            (`compat.mpu.check_mpu`; one of plain data parallelism, or the Ulysses groups that
            ``register_with_transformers`` made, is accepted), an
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
    sp = check_mpu(mpu) if mpu is not None else 1
    if sp > 1:      # DeepSpeed takes the sequence-parallel size from the mpu
        if int(raw.get("sequence_parallel_size", sp) or 1) not in (1, sp):
            raise ConfigError(f"config key 'sequence_parallel_size' = {raw['sequence_parallel_size']}, but the mpu "
                              f"passed to deepspeed.initialize has sequence-parallel groups of {sp} ranks")
        raw["sequence_parallel_size"] = sp
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
    if "optimizer" not in raw:        # DeepSpeed's engine with no optimizer: a frozen model for forward passes
        from zero_offload.inference import InferenceEngine
        stage = int((raw.get("zero_optimization") or {}).get("stage", 0))
        if stage in (1, 2):
            raise ConfigError(f"config key 'zero_optimization.stage' = {stage}: zero stage {stage} requires an "
                              f"optimizer (DeepSpeed asserts the same); build a frozen model at stage 0 or 3")
        frozen = FrozenDeepSpeedEngine(InferenceEngine(model, raw), _given_config(args, config, config_params))
        return frozen, None, None, None
    engine = Engine(model, raw, model_parameters, auto_values=auto_values)
    param_state.track(engine)
    if lr_scheduler is not None:
        if isinstance(lr_scheduler, Callable) and not hasattr(lr_scheduler, "step"):
            engine.lr_scheduler = lr_scheduler(engine.optimizer)
        else:
            engine.lr_scheduler = ClientScheduler(lr_scheduler, engine.optimizer)
    ds_engine = DeepSpeedEngine(engine, _given_config(args, config, config_params))
    loader = None
    if training_data is not None:
        loader = deepspeed_dataloader(training_data, engine, collate_fn)
    return ds_engine, ds_engine.optimizer, loader, engine.lr_scheduler


def _given_config(args, config, config_params):
    """The config as the caller gave it, which DeepSpeed keeps as ``engine.config``."""
    given = config if config is not None else config_params
    if given is None:
        given = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    return given.to_dict() if isinstance(given, Config) else given


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
