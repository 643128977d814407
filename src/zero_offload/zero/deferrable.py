"""What the ZeRO optimizers of every stage share for the delayed parameter update (see
`zero_offload.zero.delayed_update`): handing gradient partitions over whole and stepping them detached."""
from __future__ import annotations

from zero_offload.zero.grad_partition import ReadyGrad
from zero_offload.zero.partitioned_adam import PartitionedAdam

__all__ = ["DeferrableStepMixin"]


class DeferrableStepMixin:
    """For a class with ``adam`` (the partition optimizer) and ``partitions`` (its `GradPartition`s); the
    class itself says how updated parameters are published (``publish``)."""

    def _grads(self) -> list:
        # The fused-kernel optimizers wait on each partition themselves; the NVMe one takes ready tensors.
        return self.partitions if isinstance(self.adam, PartitionedAdam) else [p.ready() for p in self.partitions]

    def take_grads(self) -> list[ReadyGrad]:
        """This step's gradient partitions, handed over whole; the next backward fills other buffers."""
        return [p.take() for p in self.partitions]

    def detached_step(self, grads: list[ReadyGrad], grad_scale: float, lrs: list[float]) -> None:
        """The host step on handed-over gradients, touching nothing the model reads (any thread)."""
        self.adam.step(grads, grad_scale, lrs, publish=False)
