"""`HostStepPipeline`: the one object the engine calls for the optimizer step, whichever policy runs it.

The engine's boundary is the same under every policy (`zero_offload.hoststep.policy.StepPolicy`): it tells the
pipeline that the boundary backward starts (`begin_boundary`), finishes what an earlier step left in flight
(`flush`), and after the global norm either steps (`step`) or takes no step (`discard`, fp16 overflow); each call's
docstring says what it does under which policy. ``offload_optimizer.ratio`` is not a policy: it splits where the
state lives (`zero_offload.hoststep.split`) and combines with each. FSDP2 decides CPU offload once in the same way,
as a policy object (``CPUOffloadPolicy``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Protocol

from zero_offload.hoststep.delayed import DelayedParamUpdate, HandsOver
from zero_offload.hoststep.policy import StepPolicy

__all__ = ["HostStepPipeline", "StepOwner"]


class StepOwner(HandsOver, Protocol):
    """What the pipeline needs from a ZeRO optimizer (`ZeroOptimizer`, `Stage3Optimizer`): what the delayed update
    needs (`HandsOver`), and the step and the speculation's final ranges."""

    def step(self, grad_scale: float) -> None:
        """Step the partitions with the finished gradients x ``grad_scale`` and bring the parameters up to date."""

    def report_final_ranges(self, sinks: list) -> None:
        """Each gradient partition reports the boundary's final ranges to its sink."""

    def prepare_updates(self, grad_scale: float) -> dict:
        """Updates made before the norm (type Muon in DeepSpeed's order), {group: this rank's sum of squares}."""

    def discard_prepared(self) -> None:
        """Drop what `prepare_updates` made (no step at this boundary)."""


class HostStepPipeline:
    """Runs the optimizer step of ``zero`` by ``policy`` (see the module docstring).

    Args:
        zero: the ZeRO optimizer.
        policy: when the step runs.
        on_host: the step runs on the host (the training thread's time in it counts as host wait).
        waiting: a context that times the training thread's wait for the host step
            (`zero_offload.runtime.step_timer.StepTimer.host_wait`).
        warmup_steps: ``dpu_warmup_steps``: steps taken synchronously before the delayed update starts.

    Raises:
        RuntimeError: the delayed policy over a partition optimizer without a host-step thread.
    """

    def __init__(self, zero: StepOwner, policy: StepPolicy, on_host: bool,
                 waiting: Callable[[], ContextManager] = contextlib.nullcontext, warmup_steps: int = 0):
        self.zero, self.policy, self.on_host, self.waiting = zero, policy, on_host, waiting
        self.delayed = DelayedParamUpdate(zero, warmup_steps) if policy is StepPolicy.DELAYED else None

    def begin_boundary(self, grad_scale: float) -> None:
        """The next backward is the boundary's. Speculative (else nothing): its gradient pieces are stepped with
        ``grad_scale`` (1 / loss scale, clip coefficient 1) as they land; `step` keeps or redoes that step, exactly."""
        if self.policy is StepPolicy.SPECULATIVE:
            self.zero.report_final_ranges(self.zero.adam.begin_speculation(grad_scale))

    def flush(self, timed: bool = False) -> None:
        """Finish the step in flight and publish its parameters (delayed; else nothing is in flight). ``timed``:
        the wait is the boundary's, timed by ``waiting``."""
        if self.delayed is not None:
            with self.waiting() if timed else contextlib.nullcontext():
                self.delayed.flush()

    def wait(self) -> None:
        """Finish the step in flight without publishing it: masters and moments are final, the parameters are
        the ones the model runs on."""
        if self.delayed is not None:
            self.delayed.wait()

    def prepare(self, grad_scale: float) -> dict:
        """Before the global norm: the updates the partition optimizer makes first (type Muon in DeepSpeed 0.19.8's
        ZeRO order, from the gradients x ``grad_scale``, 1 / loss scale), {group: this rank's sum of squares} for
        the norm to count instead of those groups' gradients; {} otherwise."""
        return self.zero.prepare_updates(grad_scale)

    def step(self, grad_scale: float, global_step: int) -> None:
        """The optimizer step of step ``global_step`` with the finished gradients x ``grad_scale`` (1 / loss
        scale x clip coefficient): launched beside training (delayed, after the warm-up), or now."""
        if self.delayed is not None and self.delayed.engaged(global_step):
            self.delayed.launch(grad_scale)
            return
        with self.waiting() if self.on_host else contextlib.nullcontext():
            self.zero.step(grad_scale)

    def discard(self) -> None:
        """The boundary takes no step (fp16 overflow): what was speculated or prepared for it is dropped."""
        self.zero.discard_prepared()
        if self.policy is StepPolicy.SPECULATIVE:
            self.zero.adam.discard_speculation()

    def close(self) -> None:
        """`flush`, from `Engine.close` (the partition optimizer closes its threads)."""
        self.flush()

    def timings(self) -> dict[str, float]:
        """``host_step_s`` (the last host step's own duration, seconds) and ``host_step_threads`` (the kernel's
        thread count) where the step runs on the host; under ``super_offload`` also ``host_step_hidden_s`` (how
        much of it ran during backward) and ``host_step_kept`` (1.0 when the speculated step stood); empty where
        the step runs on the device (`Engine.timings`)."""
        adam = self.zero.adam
        if not adam.on_host:
            return {}
        out = {"host_step_s": adam.host_step_s, "host_step_threads": float(adam.host_threads)}
        if adam.speculation is not None:
            out["host_step_hidden_s"] = adam.speculation.hidden_s
            out["host_step_kept"] = float(adam.speculation.last == "accepted")
        return out
