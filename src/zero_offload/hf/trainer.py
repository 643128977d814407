"""transformers' ``Trainer`` on zero-offload's engine: ``Trainer(..., ds_config=...)`` with no DeepSpeed installed.

``ZeroOffloadTrainerMixin`` puts the engine under any ``transformers.Trainer`` subclass
(``class MySFT(ZeroOffloadTrainerMixin, SFTTrainer)``); `Trainer` is the mixin over ``transformers.Trainer``.
The Trainer's own loop runs unchanged (data, accumulation, logging, evaluation, callbacks, checkpoint
rotation); the engine takes the parts DeepSpeed takes under transformers 5.x (``integrations/deepspeed.py`` and
accelerate's ``DeepSpeedEngineWrapper``):

- at ``train()`` the config's ``"auto"`` values are filled from the ``TrainingArguments``
  (`config_fill.fill_from_training_args`, transformers' ``HfTrainerDeepSpeedConfig``), then as accelerate
  fills them, the Trainer's precision included (`config_fill.fill_as_accelerate`), and the engine is built;
- with no ``optimizer`` section the Trainer's own optimizer (``create_optimizer``: AdamW with no weight decay on
  biases and norm weights) becomes the section and param groups, stepped on the partitions; with no
  ``scheduler`` section the Trainer's ``lr_scheduler_type`` schedule (``create_scheduler``) drives the
  engine's learning rates (transformers' ``deepspeed_optim_sched``);
- each micro-batch's backward goes to `Engine.backward` (the Trainer's loss, already divided by its
  accumulation, is passed on undivided), and at the Trainer's accumulation boundary `Engine.step` runs: global
  norm, clipping (``gradient_clipping`` = ``max_grad_norm``), the partitioned step and the schedule; the
  logged ``grad_norm`` is the engine's norm before clipping;
- ``save_model`` writes ``save_pretrained``'s directory from the gathered weights (safetensors, tied weights
  kept); checkpoints (``save_steps``) add the engine's sharded state, which ``train(resume_from_checkpoint=)``
  loads.
"""
from __future__ import annotations

import contextlib
import os

import transformers

from zero_offload.compat.export import gathered_state_dict
from zero_offload.compat.optimizer import client_optimizer_config
from zero_offload.config import ConfigError
from zero_offload.engine import Engine
from zero_offload.hf.config_fill import fill_as_accelerate, fill_from_training_args, load_ds_config
from zero_offload.hf.facades import EngineModule, EngineOptimizer, EngineSchedule
from zero_offload.hf.pretrained import sharded_from_pretrained
from zero_offload.inference import InferenceEngine

__all__ = ["ZeroOffloadTrainerMixin", "Trainer"]


# The Trainer methods the mixin takes over while the engine trains (transformers' own DeepSpeed path uses the same
# points); a subclass's override of one of them would never run, so it is refused at construction.
ENGINE_HOOKS = ("_prepare_for_training", "_wrap_model", "_move_model_to_device", "_clip_grad_norm",
                "_get_grad_norm", "save_model", "_save_optimizer_and_scheduler", "_load_from_checkpoint",
                "_load_best_model")


def check_overrides(cls: type) -> None:
    """Raises TypeError naming the first `ENGINE_HOOKS` method a class in ``cls``'s MRO (other than the mixin and
    ``transformers.Trainer``) defines: the engine serves that step, and the override would be skipped."""
    for klass in cls.__mro__:
        if klass in (ZeroOffloadTrainerMixin, transformers.Trainer, object) or \
                klass.__module__ == __name__:
            continue
        for name in ENGINE_HOOKS:
            if name in klass.__dict__:
                raise TypeError(f"{klass.__qualname__}.{name} overrides a Trainer method that zero-offload's "
                                f"engine takes over with ds_config= (as transformers' DeepSpeed path does): it "
                                f"would never run. Remove it, or train without ds_config")


class ZeroOffloadTrainerMixin:
    """Adds ``ds_config`` (a dict or a path to a DeepSpeed JSON) to a ``transformers.Trainer`` subclass; with it
    the model trains on zero-offload's engine at the config's stage and offload. Without it the class is the
    plain Trainer.

    Attributes:
        ds_config: the config as given (a dict), before ``"auto"`` values are filled; None without one.
        engine: the `zero_offload.Engine` once ``train()`` built it (kept for later ``train``, ``evaluate``
            and ``save_model`` calls), else None.
        frozen_engines: the `InferenceEngine` of each frozen model prepared for evaluation (a reference or reward
            model) at stage 3.

    Raises (at construction):
        ConfigError: ``ds_config`` is not a dict or a readable config file.
        ValueError: ``TrainingArguments.deepspeed`` is set too, or ``optimizers=`` was passed (as transformers
            refuses it under DeepSpeed: override ``create_optimizer`` or give the config an optimizer section).
        TypeError: the subclass overrides a method the engine takes over (`ENGINE_HOOKS`), named.
    """

    def __init__(self, *args, ds_config=None, **kwargs):
        if ds_config is not None:
            check_overrides(type(self))
        self.ds_config = load_ds_config(ds_config) if ds_config is not None else None
        self.engine: Engine | None = None
        self.frozen_engines: list[InferenceEngine] = []
        stage3 = self.ds_config is not None and self.ds_config.get("zero_optimization", {}).get("stage") == 3
        with sharded_from_pretrained() if stage3 else contextlib.nullcontext():
            super().__init__(*args, **kwargs)      # a TRL trainer given a model name loads it a shard per rank
        if self.ds_config is None:
            return
        if getattr(self.args, "deepspeed", None):
            raise ValueError("TrainingArguments.deepspeed is set and ds_config= is given: pass the DeepSpeed config "
                             "once, as ds_config= (TrainingArguments.deepspeed needs the deepspeed package)")
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise ValueError("Trainer(optimizers=...) cannot be used with ds_config= (transformers refuses it under "
                             "DeepSpeed too): give the config an 'optimizer' section, or override create_optimizer")

    # -- frozen models (reference and reward models) ---------------------------------------------------------
    def create_accelerator_and_postprocess(self):
        """The Trainer's accelerator; with ``ds_config`` its ``prepare_model(model, evaluation_mode=True)`` (how
        TRL and the Trainer prepare a reference or reward model without DeepSpeed) builds an `InferenceEngine`
        at stage 3, as TRL's ``prepare_deepspeed`` builds a DeepSpeed engine without optimizer there."""
        out = super().create_accelerator_and_postprocess()
        if self.ds_config is not None:
            prepare = self.accelerator.prepare_model

            def prepare_model(model, device_placement=None, evaluation_mode=False):
                if evaluation_mode and model is not getattr(self, "model", None):
                    engine = self.frozen_engine(model)
                    if engine is not None:
                        return engine.module
                return prepare(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
            self.accelerator.prepare_model = prepare_model
        return out

    def frozen_engine(self, model) -> InferenceEngine | None:
        """An `InferenceEngine` over ``model`` (frozen: a reference or reward model) with this config's stage,
        ``offload_param`` and precision, kept in ``frozen_engines``; None below stage 3, where the model stays
        whole on the device as accelerate places it (DeepSpeed's stage 0 under ``prepare_deepspeed``)."""
        config = load_ds_config(self.ds_config)
        config.pop("optimizer", None), config.pop("scheduler", None)
        fill_as_accelerate(fill_from_training_args(config, self.args, 1), self.args)
        if config.get("zero_optimization", {}).get("stage") != 3:
            return None
        engine = InferenceEngine(model, config)
        self.frozen_engines.append(engine)
        return engine

    # -- building the engine --------------------------------------------------------------------------------
    def _move_model_to_device(self, model, device):
        if self.ds_config is None:
            return super()._move_model_to_device(model, device)
        return None     # the engine places the parameters (at stage 3, one unit at a time)

    def build_engine(self, num_training_steps: int) -> Engine:
        """Fill ``ds_config`` from the arguments and build the engine over ``self.model`` (once; a later call
        returns the same engine). Called by ``train()``.

        Raises:
            ConfigError: a config key that mismatches its ``TrainingArguments`` value (every one listed), an
                invalid config (the key named), or with no ``optimizer`` section a Trainer optimizer
                (``TrainingArguments.optim``) that is not a ``torch.optim`` class.
        """
        if self.engine is not None:
            return self.engine
        config = fill_from_training_args(load_ds_config(self.ds_config), self.args, num_training_steps)
        fill_as_accelerate(config, self.args)
        groups = None
        if "optimizer" not in config:
            self.optimizer = None
            torch_opt = self.create_optimizer()
            self.optimizer = None
            try:
                config["optimizer"], groups = client_optimizer_config(torch_opt, self.model)
            except ValueError:
                optim = getattr(self.args.optim, "value", self.args.optim)
                raise ConfigError(f"TrainingArguments.optim = {optim!r} gives {type(torch_opt).__module__}."
                                  f"{type(torch_opt).__name__}, which is not a torch.optim optimizer and cannot "
                                  f"run on zero-offload's partitions; use optim='adamw_torch' (or another "
                                  f"torch.optim one) or add an 'optimizer' section to ds_config") from None
        engine = Engine(self.model, config, groups)
        if self.args.torch_compile:       # what the plain Trainer compiles (through accelerate), compiled in place
            mode = self.args.torch_compile_mode
            engine.compile(backend=self.args.torch_compile_backend or "inductor",
                           compile_kwargs={"mode": mode} if mode else None)
        if "scheduler" not in config:     # the Trainer's own schedule over the engine's optimizer
            self.lr_scheduler = None
            engine.lr_scheduler = self.create_scheduler(num_training_steps, optimizer=engine.optimizer)
            self.lr_scheduler = None
        self.engine = engine
        return engine

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.ds_config is None:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        engine = self.build_engine(max_steps)
        if not isinstance(self.model_wrapped, EngineModule):
            self.model_wrapped = EngineModule(engine)
        self.optimizer, self.lr_scheduler = EngineOptimizer(engine), EngineSchedule(engine)
        if resume_from_checkpoint is not None:
            engine.load_checkpoint(resume_from_checkpoint)
            self.lr_scheduler.record()
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model_wrapped, train_dataloader

    def _wrap_model(self, model, training=True, dataloader=None):
        if self.engine is not None:
            return self.model_wrapped     # evaluation and prediction run through the engine too
        return super()._wrap_model(model, training, dataloader)

    # -- the step --------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's (or the subclass's) ``training_step``, with ``accelerator.backward`` sent to
        `engine_backward` for its duration."""
        if self.engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        accelerator = self.accelerator
        accelerator.backward = self.engine_backward      # an instance attribute shadows the method
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            del accelerator.backward

    def engine_backward(self, loss, **kwargs) -> None:
        """accelerate's ``DeepSpeedEngineWrapper.backward`` for our engine: backward of ``loss`` as the Trainer
        scaled it (the engine's division by gradient_accumulation_steps is undone), the boundary where the
        Trainer syncs (``accelerator.sync_gradients``; a shorter last accumulation ends there), and there
        `Engine.step`."""
        engine = self.engine
        gas = engine.gradient_accumulation_steps
        sync = bool(self.accelerator.sync_gradients)
        engine.backward(loss * gas if gas > 1 else loss, end_accumulation=sync)
        if sync:
            self.lr_scheduler.record()
            engine.step()

    def _clip_grad_norm(self, model):
        if self.engine is None:
            return super()._clip_grad_norm(model)
        return self.engine.last_grad_norm     # clipped inside Engine.step, with gradient_clipping

    def _get_grad_norm(self, model, grad_norm=None):
        if self.engine is None:
            return super()._get_grad_norm(model, grad_norm)
        return self.engine.last_grad_norm

    # -- saving and loading ------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``: a directory ``from_pretrained`` loads, written from the engine's weights (at
        stage 3 gathered one unit at a time: a collective, every rank calls it), in the training dtype, tied
        weights kept. Before ``train()`` built the engine, the plain Trainer's."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = gathered_state_dict(self.engine)
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir)     # sharded: every rank writes its partitions, and the schedule

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self.ds_config is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r} is not a directory")
        return None     # the engine's sharded state is loaded in train(), once the engine exists

    def _load_best_model(self):
        if self.engine is None:
            return super()._load_best_model()
        self.engine.load_checkpoint(self.state.best_model_checkpoint)


class Trainer(ZeroOffloadTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with one more keyword, ``ds_config``: a dict or a path to a DeepSpeed JSON
    (``"auto"`` values allowed, filled as transformers fills them). See `ZeroOffloadTrainerMixin`."""
