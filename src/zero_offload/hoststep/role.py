"""`PartitionOptimizer`: the role a rank's partition optimizer plays for the ZeRO optimizers and checkpoints.

Filled by the partition optimizers `zero_offload.hoststep.builder` chooses (`PartitionedAdam` and its subclasses,
`NvmeAdam`, `NvmeMuon`, `SplitAdam`, `zero_offload.nvme.param_writeback.WriteBackOptimizer`). Every member below is
used by `ZeroOptimizerBase`, the ZeRO optimizers, the checkpoints or the host-step pipeline, and nothing else is:
callers never probe for a member. `GradSource` is the other side of the step: what a partition optimizer reads,
filled by the gradient partitions of `zero_offload.zero.grad_partition`.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Protocol, Sequence, runtime_checkable

import torch

from zero_offload.runtime.host_thread import HostThread
from zero_offload.hoststep.speculation import FinalRanges, Speculation
from zero_offload.offload.handles import CopyHandle
from zero_offload.runtime.state import StateChunk

__all__ = ["PartitionOptimizer", "GradSource"]


class GradSource(Protocol):
    """A gradient partition a partition optimizer reads in its step (`GradPartition`, or `ReadyGrad`), made ready
    once per boundary by its owner (the ZeRO optimizer's ``finalize_backward``, before the norm)."""

    def ready(self) -> torch.Tensor:
        """The finished gradient partition, 1-D (training dtype, or fp32 under gradient accumulation).

        Raises:
            RuntimeError: copies into it are still in flight (read before ``finalize_backward``).
        """

    def released(self, lo: int, hi: int, reader: CopyHandle) -> None:
        """The step is done with elements [lo, hi) once ``reader``'s copy up has read them (chunks in descending
        order; see `zero_offload.offload.buffer_lease`)."""


@runtime_checkable
class PartitionOptimizer(Protocol):
    """Adam (or a torch optimizer) over one 1-D partition per param group.

    Attributes:
        optimizer: a ``torch.optim.Optimizer`` whose ``param_groups`` carry the live hyper-parameters (the LR
            schedule writes ``lr`` there).
        masters: per group, the fp32 master partition, shape (partition numel,); may be read lazily (NVMe:
            each item is read from the swap file into a new tensor).
        on_host: whether the step runs on the host.
        host_step_s: on the host, the last step's own duration in seconds, on the thread that ran it.
        host_threads: on the host, the kernel's thread count.
        host_thread: the one thread a host step beside training runs on (the delayed update's step, the speculated
            pieces), or None where every step runs on the caller's thread.
        speculation: ``super_offload``'s speculative step (its timings and verdict), or None.
    """

    optimizer: torch.optim.Optimizer
    masters: Sequence[torch.Tensor]
    on_host: bool
    host_step_s: float
    host_threads: int
    host_thread: HostThread | None
    speculation: Speculation | None

    def step(self, grads: Sequence[GradSource], grad_scale: float, lrs: Sequence[float] | None = None,
             publish: bool = True) -> None:
        """Update every group's partition with ``grads[g].ready()`` (1-D, the partition's numel, training dtype
        or fp32) x ``grad_scale`` (1 / loss scale x clip coefficient). The gradients are read without waiting:
        their owner made them ready (``finalize_backward``). ``lrs`` overrides the groups' learning rates (the
        delayed update takes them at launch). The updated parameters land in the partitions, or, with
        ``publish=False`` on a deferred optimizer, at the next `publish`.

        Raises:
            RuntimeError: a gradient source that is not ready; NVMe: an I/O error now or earlier (fail-stop).
        """

    def publish(self) -> None:
        """Deferred: write the parameters of the last step into the partitions (a no-op when not deferred)."""

    def publish_reader(self, g: int) -> "tuple[object, torch.Tensor] | None":
        """The copy up (a `CopyHandle`) that the last publish queued from one of group ``g``'s gradient buffers,
        and that buffer; None when publish read no gradient buffer (every optimizer that is never deferred)."""

    def begin_speculation(self, grad_scale: float) -> list[FinalRanges]:
        """``super_offload``: the boundary micro-step starts; its gradient pieces are stepped with ``grad_scale`` as
        they land. Returns one `FinalRanges` per group, for its gradient partition to report them to."""

    def discard_speculation(self) -> None:
        """The boundary takes no step (fp16 overflow, a checkpoint load): drop what was speculated (a no-op
        without ``super_offload``)."""

    def close(self) -> None:
        """Finish the I/O and copies in flight and end what the optimizer started (NVMe: its I/O threads and
        swap files); from `Engine.close`. Idempotent."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The host/device tensors held for optimizer state, by kind (``master``, ``exp_avg``, ``exp_avg_sq``;
        NVMe adds ``nvme_buffers``), for memory accounting."""

    def swapped_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state kept in NVMe swap files, by kind (empty when all of it is in memory)."""

    def staging_tensors(self) -> list[torch.Tensor]:
        """Host buffers that only carry updated 16-bit parameters on their way out (for memory accounting)."""

    def incoming_tensors(self) -> list[torch.Tensor]:
        """Device buffers the delayed update's step lands updated parameters in before `publish` (for memory
        accounting; empty without it)."""

    def write_master(self, g: int, offset: int, values: torch.Tensor) -> None:
        """Overwrite group ``g``'s fp32 master weights at ``offset`` with ``values`` (1-D), as
        ``gathered_parameters(modifier_rank=...)`` does."""

    def state_format(self) -> str:
        """What the checkpoint's moment slots hold: ``adam``, or ``torch.<type>:<state names>``."""

    def group_step(self, g: int) -> int:
        """Optimizer steps taken by group ``g`` (0 before the first)."""

    def state_chunks(self, g: int, chunk_numel: int = 1 << 24) -> Iterator[StateChunk]:
        """Group ``g``'s state as (offset, {kind: fp32 CPU tensor}) pieces in increasing offset (see
        `zero_offload.runtime.state.PartitionedOptimizerState.state_chunks`)."""

    def load_state_chunks(self, g: int, step: int, chunks: Iterable[StateChunk]) -> None:
        """Replace group ``g``'s state from pieces covering its partition, with ``step`` steps taken, and write
        its parameters from the new masters.

        Raises:
            ValueError: pieces that do not cover the partition in order (`zero_offload.runtime.state.checked_chunks`).
        """

    def state_dict(self) -> dict:
        """{"groups": [{"step", "master", "exp_avg", "exp_avg_sq"}]}: every group whole
        (`zero_offload.runtime.state.WholeGroupState`)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s output (same partition sizes).

        Raises:
            ValueError: another number of groups or a partition of another size.
        """
