"""The delayed parameter update (DPU) of ZeRO-Offload (Ren et al. 2021, arXiv 2101.06840, Sec. 5.2).

After ``dpu_warmup_steps`` synchronous steps, the host step of step t runs on the host-step thread while the forward
and backward of step t+1 run on the parameters of step t-1; the next boundary joins it and publishes its parameters
before step t+1's host step is launched: one step stale (docs/delayed-update.md). The step touches only what no
forward or backward reads (the handed-over gradients, masters, moments, staging outputs), takes the learning rates at
launch, and runs beside the next forward's Python (the kernel releases the GIL). DeepSpeed has no counterpart.
"""
from __future__ import annotations

from typing import Protocol

from zero_offload.runtime.host_thread import HostThreadError
from zero_offload.hoststep.role import PartitionOptimizer
from zero_offload.offload import timeline

__all__ = ["DelayedParamUpdate", "HandsOver"]


class HandsOver(Protocol):
    """What `DelayedParamUpdate` needs from a ZeRO optimizer (`ZeroOptimizer`, `Stage3Optimizer`): its partition
    optimizer, the gradient partitions handed over whole, and the publication of a finished step."""
    adam: PartitionOptimizer

    def take_grads(self) -> list: ...

    def publish(self) -> None: ...


class DelayedParamUpdate:
    """Runs the host step of a ZeRO optimizer one step behind, on its host-step thread: per boundary `flush`, then
    `launch` (after the warm-up) or a synchronous step by the caller.

    Args:
        zero: the ZeRO optimizer whose host step is delayed; its host-step thread runs the step.
        warmup_steps: optimizer steps (``global_step`` values below it) that run synchronously.

    Raises:
        RuntimeError: the partition optimizer runs no step beside training (no host-step thread).
    """

    def __init__(self, zero: HandsOver, warmup_steps: int):
        self.zero, self.warmup_steps = zero, warmup_steps
        if zero.adam.host_thread is None:
            raise RuntimeError("the partition optimizer has no host-step thread: the delayed update needs the fused "
                               "host kernel with offload_optimizer.delayed_param_update")
        self.thread = zero.adam.host_thread
        self.unpublished = False     # a finished step whose parameters the model does not run on yet

    def engaged(self, global_step: int) -> bool:
        """True when the step numbered ``global_step`` (0-based) runs delayed: after the warm-up."""
        return global_step >= self.warmup_steps

    def launch(self, grad_scale: float) -> None:
        """Start this step's host step in the background on the gradients as they are now."""
        self.flush()
        grads = self.zero.take_grads()
        lrs = [g["lr"] for g in self.zero.adam.optimizer.param_groups]
        self.unpublished = True
        tl = timeline.current()
        if tl is not None:
            tl.launched(self.thread.name)
        self.thread.submit(lambda: self._detached_step(grads, grad_scale, lrs))

    def _detached_step(self, grads: list, grad_scale: float, lrs: list[float]) -> None:
        """The host step on handed-over gradients, touching nothing the model reads (on the host-step thread):
        masters, moments and staging outputs change; the parameters only at `flush`."""
        try:
            self.zero.adam.step(grads, grad_scale, lrs, publish=False)
        finally:
            for g in grads:     # lent gradient buffers are free once the step is over, also when it failed
                g.finish()

    def wait(self) -> None:
        """Join the step in flight (masters and moments are then final); parameters stay as they are.

        Raises:
            RuntimeError: the background step failed (chained to its exception).
        """
        try:
            self.thread.join()
            tl = timeline.current()
            if tl is not None:
                tl.joined(self.thread.name)
        except HostThreadError as e:
            self.unpublished = False
            raise RuntimeError("the delayed host optimizer step failed in its background thread") from e.__cause__

    def flush(self) -> None:
        """Join the step in flight and copy its parameters up: afterwards the model runs on them."""
        self.wait()
        if self.unpublished:
            self.unpublished = False
            self.zero.publish()
