"""The training engine: micro-steps, the accumulation boundary, precision, clipping and the LR schedule.

`initialize(model, config)` wraps a model; the engine then mirrors DeepSpeed's: ``engine(x)`` runs the
forward, ``engine.backward(loss)`` scales the loss and reduces gradients across ranks, ``engine.step()``
takes the optimizer step at the gradient-accumulation boundary and is a no-op otherwise.
"""
from __future__ import annotations

from typing import Iterable

import contextlib

import torch
from torch.utils._pytree import tree_map

from zero_offload.comm import DistContext, deadline
from zero_offload.runtime.compiling import compile_module
from zero_offload.config import AutoContext, Config, ConfigError
from zero_offload.engine_state import EngineState
from zero_offload.offload import checkpoint_offload
from zero_offload.offload.copies import make_copies
from zero_offload.offload.state_offload import StateOffload
from zero_offload.optim.lr_schedules import build_scheduler
from zero_offload.precision import LossScaler, is_overflow, training_dtype
from zero_offload.runtime.stats import StepStats
from zero_offload.sequence.check import groups_for as sequence_groups_for
from zero_offload.sequence.loss import sequence_loss
from zero_offload.runtime.step_timer import StepTimer
from zero_offload.hoststep.builder import build_partition_optimizer
from zero_offload.hoststep.pipeline import HostStepPipeline
from zero_offload.hoststep.policy import StepPolicy
from zero_offload.param_groups import param_groups
from zero_offload.zero import ZeroOptimizer
from zero_offload.zero.stage3 import Stage3Optimizer
from zero_offload.zero.stage3.materialize import is_meta_model

__all__ = ["Engine", "initialize"]



def initialize(model: torch.nn.Module, config: "Config | dict | str",
               model_parameters: Iterable | None = None, param_init_fn=None) -> "Engine":
    """Wrap ``model`` for ZeRO training as ``config`` says (a dict, a JSON path or a `Config`).

    ``model_parameters`` optionally gives parameters or param-group dicts (``{"params": [...],
    "weight_decay": 0.0}``), as ``deepspeed.initialize(model_parameters=...)`` takes them; by default every
    parameter with ``requires_grad`` forms one group. ``param_init_fn(module)`` initialises the modules of a
    model built under `init_sharded` (stage 3) as they are materialised.

    Raises:
        ConfigError: an invalid config (the message names the key), no ``optimizer`` section, or batch sizes
            that do not divide.
        ValueError: a model with no trainable parameters, or a group naming a parameter not in the model.
    """
    return Engine(model, config, model_parameters, param_init_fn)


class Engine(EngineState):
    """A model under ZeRO stage 0-3, optionally with the optimizer (and at stage 3 the parameters)
    offloaded to the host.

    Attributes:
        module: the user's model (its parameters are now views into flat buffers).
        global_step: optimizer steps taken, skipped fp16-overflow steps included (DeepSpeed's global_steps).
        skipped_steps: steps skipped because the fp16 gradients overflowed.
        micro_steps: backward passes so far.
        last_grad_norm: the global gradient norm of the last boundary step (before clipping); None before.
        last_step_skipped: the last boundary step was skipped (fp16 overflow, a non-finite bf16 gradient).
        timings: {key: seconds} of the last optimizer step (of the one in progress until its ``step()``):
            ``forward_s``, ``backward_s``, ``optimizer_s`` (host wall-clock in each, all micro-steps),
            ``step_s`` (wall-clock from the step's first forward or backward to the end of ``step()``, so the
            three phases sum to at most it) and ``exposed_host_step_s`` (wall-clock the training thread spent in
            the host optimizer step or waiting for the delayed update's thread, part of ``optimizer_s``). On CUDA
            also the device's time measured with CUDA events on the current stream: ``device_forward_s``,
            ``device_backward_s``, ``device_optimizer_s``, ``device_step_s`` and ``device_exposed_host_step_s``
            (how long the device waited on the host step or the delayed update). Where the step runs on the
            host: ``host_step_s``, the last host step's own duration on the thread that ran it (under the delayed
            update, the step that finished at this boundary), and ``host_step_threads``, the kernel's thread
            count (every core; under the delayed update ``offload_optimizer.cpuadam_cores_perc`` of them).
            Reading them after a step
            waits for that step's last event (`zero_offload.runtime.step_timer`); DeepSpeed's ``wall_clock_breakdown``
            synchronises at every phase instead.
        stats: `zero_offload.runtime.stats.StepStats` of the last optimizer step (gathers, reductions, bytes copied
            each way, host syncs); all zero before the first.
    """

    def __init__(self, model: torch.nn.Module, config: "Config | dict | str", model_parameters=None,
                 param_init_fn=None, auto_values: dict | None = None):
        self.ctx = DistContext.create()
        self.config = Config.load(config, auto=AutoContext(self.ctx.world_size, model, self.ctx.device,
                                                           dict(auto_values or {})))
        if self.config.optimizer is None:   # deepspeed.initialize turns a client optimizer into this section
            raise ConfigError("config key 'optimizer' is missing: zero-offload has no default optimizer; add e.g. "
                              '"optimizer": {"type": "AdamW", "params": {"lr": 0.0003}}')
        # Ulysses: ranks per sequence (ZeRO still partitions over every rank; the replicas are world / size)
        self.sequence = sequence_groups_for(model, self.config.sequence_parallel_size)
        self.batch = self.config.batch_sizes(self.ctx.world_size // self.sequence.size)
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        self.dtype = training_dtype(self.config)
        stage3 = self.config.zero_optimization.stage == 3
        if is_meta_model(model) and not stage3:
            raise ValueError("a model built under zero_offload.init_sharded (meta parameters) needs "
                             "'zero_optimization.stage' = 3")
        if stage3:
            # Parameters move to the device one unit at a time, never the whole model at once.
            self.module = model if is_meta_model(model) else model.to(dtype=self.dtype)
        else:
            self.module = model.to(device=self.ctx.device, dtype=self.dtype)
        self.device = self.ctx.device
        groups = self._param_groups(model_parameters)
        gas = self.batch.gradient_accumulation_steps
        self.zero = (Stage3Optimizer(self.ctx, self.config, self.module, groups, gas, self.dtype, param_init_fn,
                                     build_step=build_partition_optimizer)
                     if stage3 else ZeroOptimizer(self.ctx, self.config, groups, gas, build_partition_optimizer))
        # Buffers and frozen parameters start from rank 0's values too (trainable ones were broadcast above).
        # (Stage 3 shards frozen parameters too, from rank 0's values.)
        self.ctx.broadcast_from_first([*self.module.buffers(),
                                       *(p.data for p in self.module.parameters()
                                         if not p.requires_grad and not self.zero.manages(p))])
        self.optimizer = self.zero.optimizer
        for group in self.optimizer.param_groups:       # each group's base lr, as torch's LR schedulers record it
            group.setdefault("initial_lr", group["lr"])
        self.scaler = LossScaler(self.config)
        self.lr_scheduler = build_scheduler(self.config.scheduler, self.optimizer)
        self.global_step = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._boundary_pending = False
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False      # the last boundary step was skipped (fp16 overflow): DeepSpeed's overflow
        self._timer = StepTimer(self.device)
        offload_opt = self.config.zero_optimization.offload_optimizer
        on_host = offload_opt.device in ("cpu", "nvme") or self.device.type == "cpu" or (
            stage3 and self.config.zero_optimization.offload_param.device != "none")
        self.host_step = HostStepPipeline(self.zero, StepPolicy.from_config(self.config), on_host,
                                          self._timer.host_wait, offload_opt.dpu_warmup_steps)
        self.stats = StepStats()
        self._counters = self.zero.counters()
        self._closed = False
        self._states = StateOffload(self.ctx.device)      # offload_states / reload_states
        # checkpoint inputs (and with cpu_layers whole blocks' activations) in host memory, when asked: `for_engine`
        self.checkpoint_offload = checkpoint_offload.for_engine(self.config.activation_checkpointing, self.module,
                                                                make_copies(self.device))
        self._is_compiled = False

    # -- the public step loop ----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @deadline
    def forward(self, *args, **kwargs):
        """The wrapped model's forward. Tensor inputs on another device are moved to the engine's, as
        DDP's forward does."""
        self._states.check("forward")
        with self._timer.phase("forward"):
            if torch.is_grad_enabled():
                self.zero.begin_forward()
            args, kwargs = tree_map(self._to_device, (args, kwargs))
            offload = self.checkpoint_offload
            with offload.hooks() if offload is not None and torch.is_grad_enabled() else contextlib.nullcontext():
                return self.module(*args, **kwargs)

    def gathered_for_generation(self, free_bytes: int | None = None):
        """A context for ``model.generate``: at stage 3 every unit gathered once where the ones not gathered fit
        in ``free_bytes`` (default: the device's free memory), else module by module (TRL's
        ``ds3_gather_for_generation``); a collective. Yields True when the whole model is gathered."""
        return self.zero.gathered_for_generation(free_bytes)

    @deadline
    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 end_accumulation: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` / gradient_accumulation_steps (x loss scale under fp16); with
        ``scale_wrt_gas=False`` of ``loss`` itself, as DeepSpeed's (transformers' Trainer divides its loss
        itself and passes False).

        Gradients are reduced across ranks while backward runs (stage 2: every micro-step; stages 0/1:
        on the boundary micro-step). Returns the scaled loss that was back-propagated. ``retain_graph`` is
        torch's: the graph stays for another backward through it (at stage 3 the parameters it saved are
        gathered again when that backward reads them). ``end_accumulation=True`` makes this backward the
        boundary even before gradient_accumulation_steps micro-steps ran (a shorter last accumulation of an
        epoch, as accelerate's ``set_gradient_accumulation_boundary(True)`` under transformers' ``Trainer``);
        the loss is still divided by gradient_accumulation_steps, and the next accumulation starts afresh.

        Raises:
            ValueError: ``loss`` is not a scalar tensor.
        """
        self._check_open("backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward needs a scalar loss tensor, got {type(loss).__name__} "
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        with self._timer.phase("backward"):
            return self._backward(loss, retain_graph, end_accumulation, scale_wrt_gas)

    def _backward(self, loss: torch.Tensor, retain_graph: bool, end_accumulation: bool,
                  scale_wrt_gas: bool = True) -> torch.Tensor:
        gas = self.batch.gradient_accumulation_steps
        # Another backward after the boundary one and before step() adds to the gradients to be stepped (as
        # DeepSpeed's stage 3 does); it is not a new micro-step of the next accumulation.
        extra = self._boundary_pending
        counted = (self.micro_steps + 1) % gas == 0
        boundary = extra or counted or end_accumulation
        scaled = loss.float() / gas if gas > 1 and scale_wrt_gas else loss.float()
        if self.scaler.enabled:
            scaled = scaled * self.scaler.scale
        if boundary and not extra:
            self.host_step.begin_boundary(1.0 / self.scaler.scale)   # clip coefficient 1 until the norm is known
        self.zero.begin_micro_step(boundary, first_micro_step=not extra and self.micro_steps % gas == 0)
        scaled.backward(retain_graph=retain_graph)
        self.zero.end_micro_step()
        if not extra:
            self.micro_steps += 1
            if boundary and not counted:
                self.micro_steps += -self.micro_steps % gas     # a shortened accumulation: realign the count
        self._boundary_pending = boundary
        return scaled

    def next_backward_is_boundary(self) -> bool:
        """True when the next backward completes gradient_accumulation_steps micro-steps (or adds to a boundary
        backward not yet stepped)."""
        return self._boundary_pending or (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the last backward completed a full set of micro-batches."""
        return self._boundary_pending

    def discard_accumulated_gradients(self) -> bool:
        """Drop the gradients accumulated since the last step where they are still the rank's own, unreduced:
        at stages 0/1 before the boundary backward (the micro-step count goes on). Returns whether anything
        was dropped. Stage 2/3 gradients, and stage 0/1 ones once reduced, are kept: DeepSpeed's
        ``engine.zero_grad()`` clears only ``param.grad``, which holds the accumulation at exactly those
        stages and moments (stage_1_and_2.py reduces stage 1 at the boundary and stage 2 every micro-step)."""
        if self.config.zero_optimization.stage >= 2 or self._boundary_pending:
            return False
        self.zero.zero_grad()
        return True

    @deadline
    def step(self) -> None:
        """At the accumulation boundary: the gradients made ready (``finalize_backward``), global norm, fp16
        overflow check, clipping, the partitioned optimizer step, the all-gather and the LR schedule; a no-op
        between boundaries.

        On fp16 overflow the step is skipped (parameters unchanged, the schedule not stepped) and counted in
        ``skipped_steps`` and ``global_step``, as DeepSpeed does.
        """
        self._check_open("step")
        if not self._boundary_pending:
            return
        with self._timer.phase("optimizer"):
            self._step()
        self._timer.end_step()
        counters = self.zero.counters()
        self.stats, self._counters = StepStats.between(self._counters, counters), counters

    @property
    def timings(self) -> dict[str, float]:
        """See the class docstring (a new dict at each read)."""
        return {**self._timer.result(), **self.host_step.timings()}

    def _step(self) -> None:
        self._boundary_pending = False
        self.host_step.flush(timed=True)   # a step still in flight (the delayed update's): its parameters go up
        self.zero.finalize_backward()   # gradients ready once; the norm and the step read them without waiting
        loss_scale = self.scaler.scale
        # Type Muon in DeepSpeed's order: the update is made first and the norm (so the clip) counts it.
        prepared = self.host_step.prepare(1.0 / loss_scale)
        norm = self.zero.grad_sq_norm(prepared).sqrt() / loss_scale
        self.last_grad_norm = float(norm)
        # fp16 overflow; bf16 skips a non-finite step too with bf16.check_grad_overflow (DeepSpeed 0.19.8).
        overflow = (self.scaler.enabled or (self.config.bf16.enabled and self.config.bf16.check_grad_overflow)) \
            and is_overflow(norm)
        self.last_step_skipped = bool(overflow)
        if overflow:
            self.skipped_steps += 1
            self.host_step.discard()
        else:
            clip = self.config.gradient_clipping
            # torch.nn.utils.clip_grad_norm_'s coefficient, folded into the one scale the kernel applies.
            coef = min(1.0, clip / (float(norm) + 1e-6)) if clip > 0 else 1.0
            self.host_step.step(coef / loss_scale, self.global_step)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.scaler.update(overflow)
        self.zero.zero_grad()
        self.global_step += 1

    def compile(self, backend="inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """Compile the wrapped model in place with ``torch.compile`` (DeepSpeed 0.19.8's ``engine.compile()``,
        same keywords; no DeepCompile), at any ZeRO stage; a second call does nothing. See
        `zero_offload.runtime.compiling.compile_module` for the arguments and docs/library.md, "torch.compile".

        Raises:
            ValueError: ``schedule`` given or ``compiled_autograd_enabled`` true (DeepCompile, compiled autograd).
        """
        if not self._is_compiled:
            compile_module(self.module, backend, compile_kwargs, schedule, compiled_autograd_enabled)
            self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether `compile` ran (DeepSpeed's ``is_compiled``; a model compiled before ``initialize`` does not
        count)."""
        return self._is_compiled

    # -- state -----------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale; 1.0 under bf16 and fp32."""
        return self.scaler.scale

    def get_lr(self) -> list[float]:
        """The current learning rate of each param group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_per_gpu

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    def sequence_parallel_loss(self, loss: torch.Tensor, shift_labels: torch.Tensor,
                               ignore_index: int = -100) -> torch.Tensor:
        """The whole sequence's mean loss from this rank's shard mean ``loss`` under sequence parallelism, with
        exact gradients at every ZeRO stage (`zero_offload.sequence.loss.sequence_loss`); ``loss`` itself at size 1."""
        return sequence_loss(loss, shift_labels, self.sequence, self.config.zero_optimization.stage, ignore_index)

    def memory_breakdown(self) -> dict[str, dict]:
        """Bytes held by this rank, by kind and device (see `ZeroOptimizerBase.memory_breakdown`); with
        ``cpu_checkpointing`` the host buffers of checkpoint inputs too (``checkpoint_inputs``), with ``cpu_layers``
        those of the blocks' activations (``layer_activations``)."""
        out = self.zero.memory_breakdown()
        if self.checkpoint_offload is not None:
            out.update(self.checkpoint_offload.memory_breakdown())
        return out

    @property
    def optimizer_state(self):
        """This rank's optimizer partitions (`zero_offload.runtime.state.PartitionedOptimizerState`)."""
        return self.zero

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """DeepSpeed's ``offload_states``: the ``include``d state types (``OffloadStateTypeEnum`` or its values;
        all when None) that live on the device move to host memory, bitwise, until `reload_states`; forward,
        backward and step raise meanwhile. See `zero_offload.offload.state_offload` and docs/library.md.

        Raises:
            ValueError: ``device`` other than ``"cpu"`` (``"none"`` warns and does nothing), or an unknown type.
        """
        if self._states.accepts(device, include):
            self.flush_delayed_update()
            self.zero.release_gathered()
            self._states.offload_kinds(self.zero.memory_kinds(), include, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's ``reload_states``: what `offload_states` moved comes back; a no-op when nothing did."""
        self._states.reload(non_blocking)

    def flush_delayed_update(self) -> None:
        """Delayed parameter update: finish the host step in flight and copy its parameters up now, so the
        model runs on the latest parameters (done by `save_checkpoint`, so that a resumed run continues
        exactly as the saving one does). A no-op without ``delayed_param_update``."""
        self.host_step.flush()

    def close(self) -> None:
        """End the run: finish the delayed step in flight and copy its parameters up, let every copy, staged
        add, collective and NVMe request in flight finish, join every thread the engine started and delete its
        swap files. Idempotent; the module keeps its (16-bit) parameters, and `full_state_dict` and
        `memory_breakdown` still work, but a further step raises. Called by `destroy` (DeepSpeed's name); a
        run that neither calls it nor deletes the engine ends the same way at interpreter exit (every engine
        thread is a `zero_offload.runtime.host_thread.HostThread`). The process group is left to whoever created it.

        Raises:
            HostThreadError: background work failed and was not raised before (everything is closed first).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.host_step.close()
        finally:
            try:
                self.zero.close()
                if self.checkpoint_offload is not None:
                    self.checkpoint_offload.copies.close()
            finally:
                self.ctx.close()

    def destroy(self) -> None:
        """DeepSpeed's ``engine.destroy()``: `close`."""
        self.close()

    # -- internals -------------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        self._states.check(what)
        if self._closed:
            raise RuntimeError(f"engine.{what}() after engine.close(): the engine's threads and swap files are gone; "
                               "build a new engine (zero_offload.initialize) to train on")

    def _to_device(self, x):
        return x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) and x.device != self.device \
            else x

    def _param_groups(self, model_parameters) -> list:
        return param_groups(self.module, model_parameters, self.config.optimizer)
