"""`ZeroOffloadPrecision`: the Lightning precision plugin through which backward and the step reach the engine.

Mirrors ``lightning.pytorch.plugins.precision.DeepSpeedPrecision`` (Lightning 2.x): ``backward`` calls the
engine's backward, ``optimizer_step`` runs the closure (training step and backward), Lightning's
``on_before_optimizer_step`` hooks, then the engine's step; ``clip_gradients`` is a no-op, since the engine
clips with its ``gradient_clipping`` (= ``Trainer(gradient_clip_val)``). Unlike DeepSpeed's, the boundary is
Lightning's: the backward inside ``optimizer_step`` ends the accumulation, so the shorter last accumulation of
an epoch steps as Lightning's default strategies step it.
"""
from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.plugins.precision import Precision

__all__ = ["ZeroOffloadPrecision"]


class ZeroOffloadPrecision(Precision):
    """fp32 on Lightning's side (``precision="32-true"``); the engine's training dtype comes from the config's
    ``bf16``/``fp16`` sections. The engine is ``model.trainer.strategy.engine``."""

    def __init__(self) -> None:
        super().__init__()
        self.at_boundary = False

    def backward(self, tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        """`Engine.backward` of Lightning's loss (already divided by ``accumulate_grad_batches``; the engine's own
        division is undone); inside ``optimizer_step`` it ends the accumulation."""
        engine = model.trainer.strategy.engine
        gas = engine.gradient_accumulation_steps
        engine.backward(tensor * gas if gas > 1 else tensor, end_accumulation=self.at_boundary)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The closure (training step and backward, the accumulation's last), the pre-step hooks, then the
        engine's step (norm, clipping, the partitioned step) with the Lightning optimizer's learning rates."""
        self.at_boundary = True
        try:
            result = closure()
        finally:
            self.at_boundary = False
        self._after_closure(model, optimizer)
        model.trainer.strategy.step_engine()
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        return None     # the engine clips inside its step (gradient_clipping)
