"""`ZeroOptimizerBase`: what the stage 0-2 `ZeroOptimizer` and the stage 3 `Stage3Optimizer` share.

Both keep this rank's reduced gradients in `GradPartition`s (``partitions``, one per param group) and step them with
one partition optimizer (``adam``, the `PartitionOptimizer` role). What they do alike around that pair lives here:
the boundary (`finalize_backward`, `grad_sq_norm`), what the host-step pipeline drives, the state face checkpoints
use, the memory accounting, the export of the fp32 masters and the running counters.

A subclass sets ``ctx``, ``stage``, ``offload``, ``grads_on_host``, ``partitions``, ``adam`` and ``copies`` in its
``__init__`` and defines ``layout()``, ``partitions_count``, ``after_load()``, ``publish()``, ``memory_kinds()``,
``gather_count()`` and ``reduction_count()``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Union

import torch
from torch.profiler import record_function

from zero_offload.comm import DistContext
from zero_offload.offload.copies import Copies
from zero_offload.runtime.state import StateChunk
from zero_offload.zero.gather import gather_masters, global_grad_sq_norm
from zero_offload.zero.grad_partition import GradPartition, ReadyGrad
from zero_offload.hoststep.role import PartitionOptimizer

__all__ = ["ZeroOptimizerBase", "MemoryKind", "BuildStep", "tally"]

# Builds a rank's partition optimizer: `zero_offload.hoststep.builder.build_partition_optimizer`'s signature. The
# engine hands it to the ZeRO optimizers, so that zero/ imports none of the host-step policies.
BuildStep = Callable[..., PartitionOptimizer]

# A kind of memory: (side, tensors) to be measured, or an entry measured elsewhere (swap files, gathered buffers).
MemoryKind = Union[tuple[str, list[torch.Tensor]], dict]


def tally(kinds: dict[str, MemoryKind]) -> dict[str, dict]:
    """{kind: {"bytes": int, "numel": int, "side": str}} from ``kinds`` in order. For (side, tensors): bytes are
    numel x element size of each tensor whose storage no earlier tensor had (fp32 masters that are the parameters
    themselves count zero bytes); numel counts every tensor. An entry already measured is kept as it is."""
    seen: set[int] = set()
    out = {}
    for kind, held in kinds.items():
        if isinstance(held, dict):
            out[kind] = held
            continue
        side, tensors = held
        nbytes = 0
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                nbytes += t.numel() * t.element_size()
        out[kind] = {"bytes": nbytes, "numel": sum(t.numel() for t in tensors), "side": side}
    return out


class ZeroOptimizerBase:
    """The shared part of the ZeRO optimizers (see the module docstring for what a subclass provides)."""

    ctx: DistContext
    stage: int
    offload: bool
    grads_on_host: bool
    partitions: list[GradPartition]
    adam: PartitionOptimizer
    copies: Copies

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer; its param groups hold the live learning rates (the LR schedule writes them)."""
        return self.adam.optimizer

    def counters(self) -> dict[str, int]:
        """Running totals behind `zero_offload.runtime.stats.StepStats`: parameter gathers and gradient reductions
        (`gather_count`, `reduction_count` of each stage), bytes copied each way and host waits on copies."""
        c = self.copies.counts
        return {"gathers": self.gather_count(), "reductions": self.reduction_count(),
                "bytes_down": c.bytes_down, "bytes_up": c.bytes_up, "host_syncs": c.host_syncs,
                "regathers": self.regather_count()}

    def regather_count(self) -> int:
        """Units gathered again by backward (stage 3 only; 0 at stages 0-2)."""
        return 0

    def finalize_backward(self) -> None:
        """Backward is over for this boundary: block until every reduced gradient copied into this rank's
        partitions has landed. The engine calls it once per boundary, before the norm; `grad_sq_norm`, `step`
        and `take_grads` then read the partitions without waiting (and raise if it was skipped). DeepSpeed waits
        at the same moment (``independent_gradient_partition_epilogue`` of stage_1_and_2.py and stage3.py);
        FSDP2 names it ``FSDPParamGroup.finalize_backward``."""
        with record_function("zero_offload.finalize_backward"):
            for p in self.partitions:
                p.finalize()

    def grad_sq_norm(self, replaced: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Squared L2 norm of the whole (loss-scaled) gradient over all ranks, a 0-dim fp32 CPU tensor (a
        collective at stage >= 1); ``replaced`` groups count what `prepare_updates` made instead of their gradient.

        Raises:
            RuntimeError: `finalize_backward` did not run since the last gradient copies were issued.
        """
        return global_grad_sq_norm(self.ctx, self.partitions, partitioned=self.stage >= 1, replaced=replaced)

    def prepare_updates(self, grad_scale: float) -> dict[int, torch.Tensor]:
        """Updates the partition optimizer makes before the norm (type Muon in DeepSpeed's order:
        `zero_offload.hoststep.muon.PartitionedMuon.prepare_updates`), {group: this rank's sum of squares};
        {} for every other optimizer."""
        prepare = getattr(self.adam, "prepare_updates", None)
        return prepare(self.partitions, grad_scale) if prepare is not None else {}

    def discard_prepared(self) -> None:
        """The boundary takes no step: what `prepare_updates` made is dropped."""
        discard = getattr(self.adam, "discard_prepared", None)
        if discard is not None:
            discard()

    def close(self) -> None:
        """Let every copy, staged add and I/O in flight finish and end the threads the parts started (staging,
        simulated streams, NVMe I/O, whose swap files are deleted); from `Engine.close`. The partitions stay
        readable."""
        for p in self.partitions:
            p.close()
        self.adam.close()
        self.copies.close()

    def release_gathered(self) -> None:
        """Free every gathered copy of the parameters (stage 3; below it there is none)."""

    def gathered_for_generation(self, free_bytes: int | None = None):
        """A context for a generation; below stage 3 every parameter is whole already (yields True)."""
        return contextlib.nullcontext(True)

    # -- what the host-step pipeline drives (zero_offload.hoststep.pipeline) ------------------------------
    def report_final_ranges(self, sinks: list) -> None:
        """The next backward is the boundary (``super_offload``): each gradient partition reports the ranges it
        makes final to its sink (one per group, from the partition optimizer's ``begin_speculation``)."""
        for partition, sink in zip(self.partitions, sinks):
            partition.report_final_ranges(sink)

    def take_grads(self) -> list[ReadyGrad]:
        """This step's gradient partitions, handed over whole; the next backward fills other buffers (or waits
        for what the step has not released of a lent one)."""
        return [p.take() for p in self.partitions]

    def publish_readers(self) -> None:
        """After the partition optimizer published: tell each gradient partition which copy up still reads one
        of its buffers (the delayed update publishes from the gradient buffer; see `GradPartition.read_by`)."""
        for g, partition in enumerate(self.partitions):
            reader = self.adam.publish_reader(g)
            if reader is not None:
                partition.read_by(*reader)

    # -- state (zero_offload.runtime.state.PartitionedOptimizerState) ---------------------------------------------
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
        """{"partitions": int, "layout": [GroupLayout JSON], "groups": the partition optimizer's ``state_dict()``
        groups}: this rank's partitions, loadable by an optimizer of the same layout (checkpoints reshard others)."""
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

    def full_master_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """{name: fp32 CPU tensor of the parameter's shape} for every trainable parameter, gathered from all
        ranks' master partitions along `layout` (`zero_offload.zero.gather.gather_masters`: a collective when
        ``partitions_count`` > 1). Afterwards ``export_stats["peak_device_bytes"]`` holds the most device bytes
        it held at once."""
        self.export_stats: dict = {}
        return gather_masters(self.ctx, self.layout(), self.adam.masters, self.partitions_count,
                              self.export_stats)

    def partition_kinds(self) -> dict[str, MemoryKind]:
        """The memory of the step's side, by kind: ``grad_partition`` (the reduced gradient partitions and their
        spares), ``grad_staging`` (the pinned slots later micro-steps' gradients come down through), the partition
        optimizer's ``master``, ``exp_avg``, ``exp_avg_sq`` (and ``nvme_buffers``, the pool NVMe states stream
        through), on the host when offloaded, ``param_staging`` (host copies of updated parameters headed to the
        device) and ``param_incoming`` (the device buffers the delayed update's step lands parameters in)."""
        side = "host" if self.offload else "device"
        # offload_optimizer.ratio < 1: the device part's kinds are named device_<kind>
        kinds = {kind: ("device" if kind.startswith("device_") else side, tensors)
                 for kind, tensors in self.adam.state_tensors().items()}
        device_grads = [t for p in self.partitions for t in p.device_state_tensors()]
        grad_side = "host" if self.grads_on_host else "device"
        return {"grad_partition": (grad_side, [t for p in self.partitions for t in p.state_tensors()]),
                **({"device_grad_partition": ("device", device_grads)} if device_grads else {}),
                "grad_staging": ("host", [t for p in self.partitions for t in p.staging_tensors()]),
                **kinds,
                "param_staging": ("host", self.adam.staging_tensors()),
                "param_incoming": ("device", self.adam.incoming_tensors())}

    def memory_breakdown(self) -> dict[str, dict]:
        """Bytes this rank holds, by kind, measured from the tensors themselves (`tally`): {kind: {"bytes": int,
        "numel": int, "side": "device" | "host" | "nvme"}}, the stage's ``memory_kinds``, then with
        ``offload_optimizer.device = nvme`` the states' swap files by kind (side ``nvme``, numel in fp32 elements).
        ``side`` is where the tensor lives logically (without an accelerator both are host memory).
        `zero_offload.estimate` predicts these same kinds; DeepSpeed has none by kind (``see_memory_usage``)."""
        out = tally(self.memory_kinds())
        for kind, nbytes in self.adam.swapped_bytes().items():
            out[kind] = {"bytes": nbytes, "numel": nbytes // 4, "side": "nvme"}
        return out

