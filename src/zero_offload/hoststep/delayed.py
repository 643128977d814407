"""The delayed parameter update (DPU) of ZeRO-Offload (Ren et al. 2021, arXiv 2101.06840, Sec. 5.2).

After ``dpu_warmup_steps`` synchronous optimizer steps, the host step of step t runs in a background
thread while the forward and backward of step t+1 run on the parameters of step t-1. At the next
boundary the thread is joined and step t's parameters are copied up (and all-gathered / re-sharded)
before step t+1's host step is launched, so step t+2's forward sees them. The gradient of step t+1 is
therefore taken at the parameters of step t-1: one step of staleness, which the paper shows does not
hurt convergence after a warm-up.

The thread touches only what no forward or backward reads: the handed-over gradient partitions (the next
backward fills a second set), the fp32 masters, the Adam moments and the 16-bit staging outputs. The
learning rates are taken when the step is launched. The host kernel releases the GIL, so the step runs
in parallel with the Python of the next forward.

The step runs on the partition optimizer's persistent host-step thread (`PartitionedAdam.host_thread`, a
`zero_offload.host_thread.HostThread`, which super_offload's speculative pieces use too: one thread and one owner
for every host step beside training), started by the first delayed step and closed with the optimizer
(`Engine.close`): no thread is created per step. A process that ends with a step in flight lets it finish at exit
(the thread is not a daemon: a daemon thread inside torch's C++ when the interpreter finalizes aborts the process,
"terminate called without an active exception").

DeepSpeed has no counterpart (no config key, no code path): this follows the paper. The host-step pipeline
(`zero_offload.hoststep.pipeline`) runs it for the ZeRO optimizers (`ZeroOptimizer`, `Stage3Optimizer`).
"""
from __future__ import annotations

from typing import Protocol

from zero_offload.host_thread import HostThreadError
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
    """Runs the host step of a ZeRO optimizer one step behind, in a background thread.

    Life cycle per boundary: `flush` (join the step in flight, copy its parameters up), then either
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
        """True when the step numbered ``global_step`` (0-based) runs delayed."""
        return global_step >= self.warmup_steps

    @property
    def pending(self) -> bool:
        """A step is running or finished but not yet copied up."""
        return self.thread.busy or self.unpublished

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

    def discard(self) -> None:
        """Join the step in flight and forget its parameters (before a checkpoint load replaces them)."""
        try:
            self.wait()
        finally:
            self.unpublished = False

    def close(self) -> None:
        """Finish the step in flight and copy its parameters up (from `Engine.close`; the optimizer closes the
        thread)."""
        self.flush()
