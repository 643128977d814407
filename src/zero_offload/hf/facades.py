"""What transformers' ``Trainer`` loop holds while zero-offload's engine trains: the model, optimizer and schedule.

The Trainer calls ``model(**inputs)``, ``optimizer.step()``, ``lr_scheduler.step()``, ``model.zero_grad()``
and ``lr_scheduler.get_last_lr()``. Under DeepSpeed, accelerate runs ``engine.step()`` inside
``accelerator.backward`` at the accumulation boundary and turns the optimizer and schedule calls into no-ops;
these facades do the same for our `Engine` (see `zero_offload.hf.trainer`). They hold no state of their own.
"""
from __future__ import annotations

import torch

from zero_offload.engine import Engine

__all__ = ["EngineModule", "EngineOptimizer", "EngineSchedule"]


class EngineModule(torch.nn.Module):
    """``trainer.model_wrapped``: an ``nn.Module`` whose only child is the model (``.module``), whose forward is
    the engine's (`Engine.forward`: at stage 3 the first micro-step records the gather order).

    It stands for the model, as DeepSpeed's engine does under accelerate: an attribute the facade does not have
    is the model's (``config``, ``generation_config``, ``is_gradient_checkpointing``, ``warnings_issued``,
    ``peft_config``, ``get_input_embeddings()``...), and setting an attribute the model has sets the model's.
    ``generate`` runs the model's with the parameters gathered once for the whole generation at stage 3
    (`Engine.gathered_for_generation`).

    ``zero_grad()`` is a no-op: the engine clears its gradients at each step, and at stages 0/1 a parameter's
    ``.grad`` is a view into the engine's flat gradient buffer, which ``module.zero_grad()`` would drop.
    """

    def __init__(self, engine: Engine):
        super().__init__()
        object.__setattr__(self, "engine", engine)      # a plain attribute: Engine is not an nn.Module
        self.module = engine.module

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)            # parameters, buffers and the child, as nn.Module
        except AttributeError:
            pass
        module = self.__dict__["_modules"].get("module")
        if module is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(module, name)

    def __setattr__(self, name: str, value) -> None:
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and name not in self.__dict__ and name != "module" and hasattr(module, name) \
                and not hasattr(type(self), name):
            setattr(module, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """The model's ``generate``; at stage 3 with every unit gathered once for it where they fit
        (`Engine.gathered_for_generation`), not module by module at each token."""
        with self.engine.gathered_for_generation():
            return self.module.generate(*args, **kwargs)

    def offload_states(self, *args, **kwargs) -> None:
        """The engine's (`Engine.offload_states`), as ``model_wrapped`` is DeepSpeed's engine under accelerate."""
        self.engine.offload_states(*args, **kwargs)

    def reload_states(self, non_blocking: bool = False) -> None:
        self.engine.reload_states(non_blocking)

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def _get_name(self) -> str:         # nn.Module's hook for repr; the Trainer reads it for label smoothing
        return type(self.module).__name__


class EngineOptimizer:
    """``trainer.optimizer``: the engine's live param groups (``param_groups``, read by callbacks and for the
    learning rate); ``step()`` and ``zero_grad()`` are no-ops, since the engine stepped at the boundary
    backward (as ``accelerate.utils.DeepSpeedOptimizerWrapper``)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self.engine.optimizer.defaults

    def step(self, closure=None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


class EngineSchedule:
    """``trainer.lr_scheduler``: ``get_last_lr()`` gives the learning rates the last optimizer step used (what
    plain ``Trainer`` logs, read after ``optimizer.step()`` and before ``lr_scheduler.step()``), or the current
    ones before the first step. ``step()`` is a no-op: the engine steps its schedule (the config's, or the
    Trainer's own ``lr_scheduler_type`` set as ``engine.lr_scheduler``). ``state_dict()`` is that schedule's."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.last_lrs = list(engine.get_lr())

    def record(self) -> None:
        """Remember the learning rates of the step about to run (call right before ``engine.step()``)."""
        self.last_lrs = list(self.engine.get_lr())

    def get_last_lr(self) -> list[float]:
        return list(self.last_lrs)

    def step(self, *args, **kwargs) -> None:
        return None

    def state_dict(self) -> dict:
        sched = self.engine.lr_scheduler
        return sched.state_dict() if sched is not None else {}

    def load_state_dict(self, state: dict) -> None:
        sched = self.engine.lr_scheduler
        if sched is not None and state:
            sched.load_state_dict(state)
