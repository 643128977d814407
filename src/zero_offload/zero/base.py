"""`ZeroOptimizerBase`: what the stage 0-2 `ZeroOptimizer` and the stage 3 `Stage3Optimizer` share.

Both keep this rank's reduced gradients in `GradPartition`s (``partitions``, one per param group) and step them
with one partition optimizer (``adam``, the `PartitionOptimizer` role built by `build_partition_optimizer`).
Around that pair the two classes do the same things, which live here once:

- the boundary: `finalize_backward` makes the gradients ready, then `grad_sq_norm` and the step read them;
- the delayed parameter update's hand-over (`take_grads`, `detached_step`; `zero_offload.zero.delayed_update`);
- the state face checkpoints use (`zero_offload.state.PartitionedOptimizerState`);
- the memory accounting (`memory_breakdown`) and the export of the fp32 masters (`full_master_state`).

A subclass sets ``ctx``, ``stage``, ``offload``, ``partitions`` and ``adam`` in its ``__init__`` and defines
``layout()``, ``partitions_count``, ``after_load()``, ``publish()`` and ``memory_kinds()``.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch.profiler import record_function

from zero_offload.comm import DistContext
from zero_offload.state import StateChunk
from zero_offload.zero.gather import global_grad_sq_norm
from zero_offload.zero.grad_partition import GradPartition, ReadyGrad
from zero_offload.zero.optimizer_role import PartitionOptimizer

__all__ = ["ZeroOptimizerBase"]


class ZeroOptimizerBase:
    """The shared part of the ZeRO optimizers (see the module docstring for what a subclass provides)."""

    ctx: DistContext
    stage: int
    offload: bool
    partitions: list[GradPartition]
    adam: PartitionOptimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer; its param groups hold the live learning rates (the LR schedule writes them)."""
        return self.adam.optimizer

    # -- the boundary ----------------------------------------------------------------------------------
    def finalize_backward(self) -> None:
        """Backward is over for this boundary: block until every reduced gradient copied into this rank's
        partitions has landed. The engine calls it once per boundary, before the norm; `grad_sq_norm`, `step`
        and `take_grads` then read the partitions without waiting (and raise if it was skipped).

        DeepSpeed waits at the same moment, in the epilogue of the boundary backward
        (``independent_gradient_partition_epilogue`` of stage_1_and_2.py and stage3.py); FSDP2 names it
        ``FSDPParamGroup.finalize_backward``.
        """
        with record_function("zero_offload.finalize_backward"):
            for p in self.partitions:
                p.finalize()

    def grad_sq_norm(self) -> torch.Tensor:
        """Squared L2 norm of the whole (loss-scaled) gradient over all ranks, a 0-dim fp32 CPU tensor (a
        collective at stage >= 1).

        Raises:
            RuntimeError: `finalize_backward` did not run since the last gradient copies were issued.
        """
        return global_grad_sq_norm(self.ctx, self.partitions, partitioned=self.stage >= 1)

    # -- the delayed parameter update (zero_offload.zero.delayed_update) ---------------------------------
    def take_grads(self) -> list[ReadyGrad]:
        """This step's gradient partitions, handed over whole; the next backward fills other buffers."""
        return [p.take() for p in self.partitions]

    def detached_step(self, grads: list[ReadyGrad], grad_scale: float, lrs: list[float]) -> None:
        """The host step on handed-over gradients, touching nothing the model reads (any thread): masters,
        moments and staging outputs change; the parameters only at `publish`."""
        self.adam.step(grads, grad_scale, lrs, publish=False)

    # -- state (zero_offload.state.PartitionedOptimizerState) ---------------------------------------------
    def group_step(self, g: int) -> int:
        return self.adam.group_step(g)

    def state_chunks(self, g: int, chunk_numel: int = 1 << 24) -> Iterator[StateChunk]:
        return self.adam.state_chunks(g, chunk_numel)

    def load_state_chunks(self, g: int, step: int, chunks: Iterable[StateChunk]) -> None:
        self.adam.load_state_chunks(g, step, chunks)

    # Frozen parameters: stage 0-2 hold them whole in the module, where checkpoints read them directly.
    def frozen_shapes(self) -> dict:
        return {}

    def frozen_state(self, every_rank: bool = True) -> dict:
        return {}

    def load_frozen_state(self, values: dict) -> None:
        pass

    def state_format(self) -> str:
        return self.adam.state_format()

    def state_dict(self) -> dict:
        """{"partitions": int, "layout": [GroupLayout JSON], "groups": the partition optimizer's
        ``state_dict()`` groups}: this rank's partitions, loadable by an optimizer of the same layout
        (checkpoints reshard others)."""
        return {"partitions": self.partitions_count, "layout": [g.to_json() for g in self.layout()],
                **self.adam.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s output, then update the 16-bit parameters (a collective at stage >= 1).

        Raises:
            ValueError: state of another layout (other ranks, stage or model).
        """
        if state["partitions"] != self.partitions_count or state["layout"] != [g.to_json() for g in self.layout()]:
            raise ValueError("optimizer state of another partition layout (world size, stage or model); load it "
                             "through a checkpoint, which reshards")
        self.adam.load_state_dict(state)
        self.after_load()
