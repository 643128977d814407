"""`ZeroOffloadStrategy`: ``lightning.Trainer(strategy=ZeroOffloadStrategy(config=...))`` trains a
``LightningModule`` on zero-offload's engine, at any ZeRO stage and offload, with no DeepSpeed installed.

Modelled on Lightning 2.x's ``DeepSpeedStrategy`` (a ``DDPStrategy``: one process per device, the same
launchers, ``torchrun`` detected): the engine wraps the whole ``LightningModule`` and ``training_step`` /
``validation_step`` run through the engine's forward; backward and the step go through `ZeroOffloadPrecision`.
What Lightning knows fills the config: ``gradient_accumulation_steps`` = ``accumulate_grad_batches`` and
``gradient_clipping`` = ``gradient_clip_val`` (absent or ``"auto"``; another value is an error).

- With no ``optimizer`` section the module's ``configure_optimizers`` optimizer (one ``torch.optim`` optimizer)
  becomes the section and param groups; Lightning keeps that optimizer and its schedulers as usual (stepping,
  ``LearningRateMonitor``, checkpointed), and its learning rates (and betas) are copied into the engine before
  each step. It never steps itself and holds no state.
- With an ``optimizer`` section ``configure_optimizers`` is not used (as in Lightning's DeepSpeed strategy) and the
  config's ``scheduler`` section, if any, is stepped by the engine.
- Checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``) are directories: the engine's sharded state
  (tag ``checkpoint``) with Lightning's own state as its ``client_state``; ``fit(ckpt_path=...)`` restores both.
"""
from __future__ import annotations

import copy
import os
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from zero_offload.compat.optimizer import client_optimizer_config
from zero_offload.config import ConfigError
from zero_offload.engine import Engine
from zero_offload.config.io import read_config_file
from zero_offload.lightning.precision import ZeroOffloadPrecision

__all__ = ["ZeroOffloadStrategy"]


class EngineModule(torch.nn.Module):
    """``strategy.model``: the ``LightningModule`` (``.module``) with its forward run by the engine."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine
        self.module = engine.module

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)


class ZeroOffloadStrategy(DDPStrategy):
    """A Lightning strategy whose model trains on zero-offload's `Engine`.

    Args:
        config: the DeepSpeed-style config, a dict or a path to a JSON file.
        **kwargs: ``DDPStrategy``'s (``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``process_group_backend``, ``timeout``, ``start_method``, ...).

    Attributes:
        engine: the `zero_offload.Engine` once ``fit`` set it up (kept for later stages), else None.

    Raises:
        ConfigError: at construction, ``config`` is not a dict or a readable file; at ``fit``, a config value that
            differs from the Trainer's (``gradient_accumulation_steps``, ``gradient_clipping``), clipping by value,
            not exactly one optimizer, or schedulers from both the config and ``configure_optimizers``.
        ValueError: ``precision_plugin`` given (the engine's dtype comes from the config).
    """

    strategy_name = "zero_offload"

    def __init__(self, config: "dict | str", **kwargs: Any):
        if kwargs.get("precision_plugin") is not None:
            raise ValueError("ZeroOffloadStrategy(precision_plugin=...): the engine's dtype comes from the config's "
                             "'bf16'/'fp16' sections; leave Trainer(precision=...) at its default '32-true'")
        super().__init__(precision_plugin=ZeroOffloadPrecision(), **kwargs)
        self.config = _load(config)
        self.engine: Engine | None = None
        self.client_optimizer: torch.optim.Optimizer | None = None
        self.client_groups: list[int] = []

    # -- setting up ---------------------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.engine is None:
            self.engine = self.build_engine(trainer)
        if self.engine is not None:
            self.model = EngineModule(self.engine)
        else:       # validate/test/predict before any fit: the module as it is
            self.model_to_device()
        self.setup_precision_plugin()

    def build_engine(self, trainer) -> Engine:
        """The config filled from the Trainer, the optimizer chosen (see the module docstring), the engine built
        over the ``LightningModule``."""
        config = copy.deepcopy(self.config)
        _fill(config, "gradient_accumulation_steps", trainer.accumulate_grad_batches,
              "Trainer(accumulate_grad_batches)")
        _fill(config, "gradient_clipping", float(trainer.gradient_clip_val or 0.0), "Trainer(gradient_clip_val)")
        if trainer.gradient_clip_val and str(trainer.gradient_clip_algorithm).lower().endswith("value"):
            raise ConfigError("Trainer(gradient_clip_algorithm='value') is not built: the engine clips by the global "
                              "norm (gradient_clipping); use gradient_clip_algorithm='norm'")
        if config.get("train_batch_size") == "auto":
            config.pop("train_batch_size")
        if config.get("train_micro_batch_size_per_gpu", "auto") == "auto" and "train_batch_size" not in config:
            config["train_micro_batch_size_per_gpu"] = 1    # only sizes throughput figures, as in Lightning's
        groups = None
        if "optimizer" not in config:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ConfigError(f"ZeroOffloadStrategy needs exactly one optimizer from configure_optimizers, got "
                                  f"{len(self.optimizers)} (or give the config an 'optimizer' section)")
            if "scheduler" in config and self.lr_scheduler_configs:
                raise ConfigError("the config has a 'scheduler' section and configure_optimizers returns a "
                                  "scheduler too: keep one")
            self.client_optimizer = self.optimizers[0]
            try:
                config["optimizer"], groups = client_optimizer_config(self.client_optimizer, self.lightning_module)
            except ValueError as e:
                raise ConfigError(f"configure_optimizers: {e}") from None
            self.client_groups = [i for i, g in enumerate(self.client_optimizer.param_groups)
                                  if any(p.requires_grad for p in g["params"])]
        engine = Engine(self.lightning_module, config, groups)
        if self.client_optimizer is None:
            self.optimizers, self.lr_scheduler_configs = [engine.optimizer], []
        return engine

    def setup_optimizers(self, trainer) -> None:
        if self.engine is None:     # called by build_engine; afterwards the optimizers stay as built
            super().setup_optimizers(trainer)

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False    # Lightning decides the boundary (and steps on an epoch's last batch), as by default

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True     # the engine must exist to load its sharded state

    # -- the step --------------------------------------------------------------------------------------------
    def step_engine(self) -> None:
        """Copy the Lightning optimizer's learning rates (and betas) into the engine, then `Engine.step`."""
        if self.client_optimizer is not None:
            for g, i in zip(self.engine.optimizer.param_groups, self.client_groups):
                src = self.client_optimizer.param_groups[i]
                g["lr"] = float(src["lr"])
                if "betas" in src and "betas" in g:
                    g["betas"] = tuple(float(b) for b in src["betas"])
        self.engine.step()

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any | None = None) -> None:
        """A directory at ``filepath``: the engine's sharded state, with Lightning's checkpoint dict (less the
        module's weights, and the optimizer's when it is the engine's own) as its ``client_state``. A
        collective: every rank calls it (as Lightning does).

        Raises:
            TypeError: ``storage_options`` given (no ``CheckpointIO`` is used, as in Lightning's DeepSpeed).
        """
        if self.engine is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("ZeroOffloadStrategy.save_checkpoint(storage_options=...) is not supported: the engine "
                            "writes its own sharded files")
        filepath = self.broadcast(filepath)
        drop = {"state_dict"} if self.client_optimizer is not None else {"state_dict", "optimizer_states"}
        self.engine.save_checkpoint(filepath, tag="checkpoint",
                                    client_state={k: v for k, v in checkpoint.items() if k not in drop})

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """The engine's sharded state restored from the directory ``checkpoint_path``; returns Lightning's dict.

        Raises:
            ValueError: no engine (``ckpt_path`` outside ``fit``: consolidate the directory with
                ``zero_offload.consolidate`` and load the weights instead).
            CheckpointError: not a zero-offload checkpoint directory, or a damaged one; `UntrustedPickleError` (a
                CheckpointError) where Lightning's state holds a type outside the allow-list and ``weights_only`` is
                not False (`zero_offload.checkpoint.safe_pickle`).
        """
        if self.engine is None:
            raise ValueError(f"ckpt_path={str(checkpoint_path)!r}: ZeroOffloadStrategy restores checkpoints in "
                             f"fit(); for validate/test/predict load zero_offload.consolidate(path) into the module")
        # Lightning's weights_only=False is its user trusting the file: the client state then loads any type.
        trust = True if weights_only is False else None
        return self.engine.load_checkpoint(self.broadcast(checkpoint_path), trust_pickles=trust)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        return None     # the engine loaded the weights in load_checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self.client_optimizer is not None     # its param groups (learning rates); it holds no state

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if self.client_optimizer is not None:
            super().load_optimizer_state_dict(checkpoint)


def _load(config) -> dict:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(config)
    raise ConfigError(f"ZeroOffloadStrategy(config=...) must be a dict or a path to a JSON file, got "
                      f"{type(config).__name__}")


def _fill(config: dict, key: str, value, source: str) -> None:
    if config.get(key, "auto") == "auto":
        config[key] = value
    elif config[key] != value:
        raise ConfigError(f"config key '{key}' = {config[key]!r} differs from {source} = {value!r}: set it to "
                          f"'auto' or leave it out (Lightning's value is used)")
