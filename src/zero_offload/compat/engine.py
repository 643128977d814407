"""`DeepSpeedEngine`: DeepSpeed's engine face over zero-offload's `Engine`, for scripts written for DeepSpeed.

DeepSpeed's engine is an ``nn.Module`` holding the model as ``engine.module``; scripts call
``engine.parameters()``, ``engine.named_parameters()`` (names prefixed ``module.``), ``engine.train()``,
``engine.state_dict()``, and DeepSpeed's methods (``train_batch_size()`` is a method there, a property on
`Engine`). This class is that face and nothing more: every step goes to the wrapped `Engine`, and any
attribute it does not define is looked up there (``global_step``, ``memory_breakdown()``, ...).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from zero_offload.compat.optimizer_face import OptimizerFace
from zero_offload.compat.throughput import ThroughputTimer
from zero_offload.engine import Engine

__all__ = ["DeepSpeedEngine"]


class DeepSpeedEngine(torch.nn.Module):
    """An ``nn.Module`` whose only child is the model (``engine.module``), stepping through ``engine.engine``.

    Semantics mirrored from ``deepspeed.runtime.engine.DeepSpeedEngine`` (0.19.8): ``step()`` is called after
    every ``backward()`` and counts micro-steps; ``is_gradient_accumulation_boundary()`` is true from the
    start of the last micro-step of an accumulation until its ``step()``; ``load_checkpoint`` returns
    ``(path, client_state)``; ``save_16bit_model`` at stage 3 writes only with
    ``stage3_gather_16bit_weights_on_model_save`` (and returns False otherwise).
    """

    def __init__(self, engine: Engine, config: Any = None):
        super().__init__()
        self.engine = engine            # a plain attribute: Engine is not an nn.Module
        self.module = engine.module
        self._raw_config = config if config is not None else engine.config.to_dict()
        self._optimizer_face = OptimizerFace(engine)
        self.tput_timer = ThroughputTimer(batch_size=getattr(engine, "train_batch_size", 1))
        self._ds_micro_steps = 0        # DeepSpeed counts micro-steps in step(), not backward()
        self._boundary_override: bool | None = None
        self._step_applied = False

    def __getattr__(self, name: str):
        """An attribute of zero-offload's `Engine`, else of the wrapped model (DeepSpeed's engine forwards unknown
        names to its module: DeepSpeed-Chat reads ``engine.model``, the HF model's decoder)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            engine = self.__dict__.get("engine")
            if engine is None:
                raise
            try:
                return getattr(engine, name)
            except AttributeError:
                return getattr(self._modules["module"], name)

    # -- the step loop ---------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.training:
            self.tput_timer.start()
        return self.engine.forward(*args, **kwargs)

    def compile(self, backend="inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile()``: compiles the wrapped model in place (`Engine.compile`), not this
        module's call (``nn.Module.compile``, which this name would otherwise be)."""
        self.engine.compile(backend, compile_kwargs, schedule, compiled_autograd_enabled)

    @property
    def is_compiled(self) -> bool:
        return self.engine.is_compiled

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """``engine.backward(loss, retain_graph=False, scale_wrt_gas=True)``: loss / gradient_accumulation_steps
        (not divided with ``scale_wrt_gas=False``, as transformers' Trainer asks), x the fp16 loss scale;
        ``retain_graph`` keeps the graph for another backward, as torch's."""
        end = False
        if self._boundary_override is not None:
            end = self._boundary_override and not self.engine.next_backward_is_boundary()
            if not self._boundary_override and self.engine.next_backward_is_boundary():
                raise ValueError("set_gradient_accumulation_boundary(False) on the last micro-step of an "
                                 "accumulation is not built: the accumulation length is gradient_accumulation_steps")
        self.engine.backward(loss, retain_graph=retain_graph, end_accumulation=end, scale_wrt_gas=scale_wrt_gas)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """The optimizer step at the accumulation boundary (a no-op between boundaries); call it after every
        backward, as in DeepSpeed."""
        steps, skipped = self.engine.global_step, self.engine.skipped_steps
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        self.tput_timer.stop(global_step=boundary)
        if boundary:
            self._step_applied = self.engine.global_step > steps and self.engine.skipped_steps == skipped
            if self._boundary_override:
                gas = self.engine.gradient_accumulation_steps
                self.engine.micro_steps += -self.engine.micro_steps % gas
        self._ds_micro_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed 0.19.8's ``engine.zero_grad()`` sets every parameter's ``.grad`` to None. That discards
        the gradients accumulated since the last step where its ZeRO stage keeps them in ``.grad``: stages
        0 and 1 before the boundary backward (with the default ``data_types.grad_accum_dtype``). At stages 2
        and 3 (reduced into partitions every micro-step) and after a stage-1 boundary backward it changes
        nothing. The same here (`Engine.discard_accumulated_gradients`). Not mirrored: at stage 0 after the
        boundary backward DeepSpeed's next step then updates nothing; here the reduced gradients are kept."""
        for p in self.module.parameters():
            p.grad = None
        self.engine.discard_accumulated_gradients()

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        if self.engine.is_gradient_accumulation_boundary():
            return True
        return (self._ds_micro_steps + 1) % self.engine.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override whether the coming micro-step ends an accumulation (DeepSpeed's manual override); None
        goes back to counting."""
        self._boundary_override = is_boundary

    def was_step_applied(self) -> bool:
        """False when the last boundary step was skipped (fp16 overflow, or a non-finite bf16 gradient)."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        return self.engine.last_grad_norm

    # -- DeepSpeed's getters (methods there) ------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.engine.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.engine.config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled

    def gradient_clipping(self) -> float:
        return self.engine.config.gradient_clipping

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    @property
    def optimizer(self) -> OptimizerFace:
        """DeepSpeed's ZeRO optimizer face (`OptimizerFace`: ``overflow``, ``cur_scale``, ``offload_states``)."""
        return self._optimizer_face

    @property
    def config(self):
        """The config as given to ``initialize`` (a dict, or the path or string given), as DeepSpeed's
        ``engine.config``; the checked config is ``engine.engine.config``."""
        return self._raw_config

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() == 3

    def zero_offload_optimizer(self) -> bool:
        return self.engine.config.zero_optimization.offload_optimizer.device != "none"

    def zero_offload_param(self) -> bool:
        return self.engine.config.zero_optimization.offload_param.device != "none"

    def zero_cpu_offload(self) -> bool:
        return self.engine.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's switch for ``save_16bit_model`` at stage 3
        (``stage3_gather_16bit_weights_on_model_save``)."""
        return bool(self.engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def empty_partition_cache(self) -> None:
        """Release every gathered stage-3 parameter, persistent ones too (gathered again when next used)."""
        self.engine.zero.release_gathered()

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The whole model's 16-bit state dict on the CPU on rank 0, None on the others (DeepSpeed's; a
        collective: every rank calls it). Gathered one unit at a time (`compat.export.gathered_state_dict`).

        Raises:
            ValueError: the engine is not at ZeRO stage 3 (DeepSpeed raises the same).
        """
        if self.zero_optimization_stage() != 3:
            raise ValueError("this function requires ZeRO-3 mode")
        sd = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        return sd if self.engine.rank == 0 else None

    @property
    def lr_scheduler(self):
        return self.engine.lr_scheduler

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.engine.rank))

    @property
    def global_rank(self) -> int:
        return self.engine.rank

    @property
    def dp_world_size(self) -> int:
        return self.engine.world_size

    @property
    def global_steps(self) -> int:
        return self.engine.global_step

    @global_steps.setter
    def global_steps(self, value: int) -> None:
        """DeepSpeed's engines let a trainer set the step count (after loading weights elsewhere, say)."""
        self.engine.global_step = int(value)

    @property
    def global_samples(self) -> int:
        return self.engine.global_step * self.engine.train_batch_size

    @property
    def micro_steps(self) -> int:
        return self._ds_micro_steps

    # -- saving ----------------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        self.engine.save_checkpoint(save_dir, tag, client_state if client_state is not None else {})
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None) -> tuple[str | None, Any]:
        """DeepSpeed's return value: (the checkpoint's path, its client_state)."""
        from zero_offload.checkpoint import resolve_tag
        from zero_offload.checkpoint.deepspeed_read import find_deepspeed
        path = find_deepspeed(load_dir, tag) or resolve_tag(load_dir, tag)
        client_state = self.engine.load_checkpoint(load_dir, tag, load_optimizer_states=load_optimizer_states,
                                                   load_lr_scheduler_states=load_lr_scheduler_states,
                                                   load_module_only=load_module_only)
        return str(path), client_state

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()``; at stage 3 gathered (a collective), with every name, as CPU tensors."""
        from zero_offload.compat.export import gathered_state_dict
        sd = gathered_state_dict(self.engine, dtype=None)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        return {prefix + k: v for k, v in sd.items()}

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the model's 16-bit (training-dtype) state dict to ``save_dir/save_filename`` on rank 0.

        A collective. At stage 3 it needs ``zero_optimization.stage3_gather_16bit_weights_on_model_save``;
        without it nothing is written and False is returned, as DeepSpeed does.
        """
        import warnings
        if self.zero_optimization_stage() == 3 and \
                not self.engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            warnings.warn("save_16bit_model wrote nothing: at stage 3 it needs zero_optimization."
                          "stage3_gather_16bit_weights_on_model_save = true (as in DeepSpeed); "
                          "engine.save_checkpoint + zero_offload.consolidate always work", stacklevel=2)
            return False
        sd = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if self.engine.rank == 0:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            tmp = Path(save_dir) / f".{save_filename}.tmp"
            torch.save(sd, tmp)
            os.replace(tmp, Path(save_dir) / save_filename)
        self.engine.ctx.barrier() if hasattr(self.engine.ctx, "barrier") else None
        return True


class FrozenDeepSpeedEngine(DeepSpeedEngine):
    """What ``deepspeed.initialize`` builds with no optimizer (no client optimizer, no ``optimizer`` section): the
    reference, reward and evaluation models of TRL, OpenRLHF and DeepSpeed-Chat. It places the model as a
    training engine of the same config would (`zero_offload.inference.InferenceEngine`: partitioned and gathered
    module by module at stage 3), holds no gradient or optimizer state, and its ``optimizer`` is None, as
    DeepSpeed's. Unlike DeepSpeed it also sets ``requires_grad=False`` on the parameters (nothing could step them).
    """

    @property
    def optimizer(self):
        return None

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Raises: RuntimeError: an engine built without an optimizer does not train."""
        raise RuntimeError("this engine was built by deepspeed.initialize without an optimizer (a frozen model): "
                           "give an optimizer (or a config 'optimizer' section) to train it")

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Raises: RuntimeError: as `backward`."""
        self.backward(None)
