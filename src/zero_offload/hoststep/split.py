"""`SplitAdam`: the partition optimizer of ``offload_optimizer.ratio`` < 1 (see `zero_offload.zero.split_partition`).

Each group's partition is cut at `device_numel`: a device `PartitionedAdam` over the first part (torch's fused AdamW
on a GPU), and over the rest a host `PartitionedAdam` (with super_offload's speculation when configured) or an
`NvmeAdam`. Both step with the same ``grad_scale``, the device's kernels queued first so that they run while the host
steps. The learning rates live in the host optimizer's param groups (the LR schedule writes there) and are copied to
the device's before each step. The state face is one flat partition per group (device elements first), so
checkpoints reshard between any ratios.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Iterator, Sequence

import torch

from zero_offload.hoststep.nvme_adam import NvmeAdam
from zero_offload.runtime.state import StateChunk, WholeGroupState
from zero_offload.hoststep.adam import PartitionedAdam

__all__ = ["SplitAdam"]

HPARAMS = ("lr", "betas", "eps", "weight_decay")


class _Masters(Sequence):
    """Each group's fp32 master partition, read on access: the device part (copied to the host) then the host's."""

    def __init__(self, owner: "SplitAdam"):
        self.owner = owner

    def __len__(self) -> int:
        return len(self.owner.parts)

    def __getitem__(self, g: int) -> torch.Tensor:
        dev, host = self.owner.device.masters[g], self.owner.host.masters[g]
        return torch.cat([dev.detach().to("cpu", torch.float32), host.detach().to("cpu", torch.float32)])


class SplitAdam(WholeGroupState):
    """The `PartitionOptimizer` over partitions split between the device and the host.

    Args:
        parts: per group, the whole 1-D parameter partition (16-bit or fp32, on the device).
        cuts: per group, the elements kept on the device (`device_numel`).
        device: a `PartitionedAdam` over ``part[:cut]`` with the states on the device.
        host: a `PartitionedAdam` (states in host memory) or an `NvmeAdam` over ``part[cut:]``.
    """

    def __init__(self, parts: list[torch.Tensor], cuts: list[int], device: PartitionedAdam,
                 host: "PartitionedAdam | NvmeAdam"):
        self.parts, self.cuts, self.device, self.host = parts, cuts, device, host
        self.masters = _Masters(self)
        self.on_host = True

    # -- the host optimizer's face: its live learning rates, timings, thread and speculation ---------------------
    optimizer = property(lambda self: self.host.optimizer)
    host_step_s = property(lambda self: self.host.host_step_s)
    host_threads = property(lambda self: self.host.host_threads)
    host_thread = property(lambda self: self.host.host_thread)
    speculation = property(lambda self: self.host.speculation)

    def begin_speculation(self, grad_scale: float):
        return self.host.begin_speculation(grad_scale)

    def discard_speculation(self) -> None:
        self.host.discard_speculation()

    # -- the step ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grads: Sequence, grad_scale: float, lrs: Sequence[float] | None = None,
             publish: bool = True) -> None:
        """Both parts with one ``grad_scale``: ``grads[g]`` are `SplitGradPartition`s (their ``device`` and ``host``
        sources); the device's step is queued before the host's runs."""
        for dev_group, host_group in zip(self.device.optimizer.param_groups, self.host.optimizer.param_groups):
            for key in HPARAMS:
                dev_group[key] = host_group[key]
        self.device.step([g.device for g in grads], grad_scale, lrs)
        self.host.step([g.host for g in grads], grad_scale, lrs, publish)

    def publish(self) -> None:
        self.host.publish()

    def publish_reader(self, g: int):
        return self.host.publish_reader(g)

    def close(self) -> None:
        try:
            self.host.close()
        finally:
            self.device.close()

    @torch.no_grad()
    def write_master(self, g: int, offset: int, values: torch.Tensor) -> None:
        values, cut = values.reshape(-1), self.cuts[g]
        for part, lo, hi in ((self.device, 0, cut), (self.host, cut, self.parts[g].numel())):
            a, b = max(offset, lo), min(offset + values.numel(), hi)
            if a < b:
                part.write_master(g, a - lo, values[a - offset:b - offset])

    # -- memory ----------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The host part's kinds, and the device part's as ``device_<kind>``."""
        return {**self.host.state_tensors(),
                **{f"device_{k}": v for k, v in self.device.state_tensors().items()}}

    def swapped_bytes(self) -> dict[str, int]:
        return self.host.swapped_bytes()

    def staging_tensors(self) -> list[torch.Tensor]:
        return self.host.staging_tensors()

    def incoming_tensors(self) -> list[torch.Tensor]:
        return self.host.incoming_tensors()

    # -- state: one flat partition per group, the device part first --------------------------------------------
    def state_format(self) -> str:
        return "adam"

    def group_step(self, g: int) -> int:
        return self.host.group_step(g)

    def state_chunks(self, g: int, chunk_numel: int = 1 << 24) -> Iterator[StateChunk]:
        yield from self.device.state_chunks(g, chunk_numel)
        for offset, piece in self.host.state_chunks(g, chunk_numel):
            yield offset + self.cuts[g], piece

    def load_state_chunks(self, g: int, step: int, chunks: Iterable[StateChunk]) -> None:
        """The pieces before the cut load into the device part, the rest (shifted) into the host part; a piece
        across the cut is split. Checked as each part's loader checks its own pieces."""
        cut, rest = self.cuts[g], []
        it = iter(chunks)

        def device_pieces() -> Iterator[StateChunk]:
            for offset, piece in it:
                n = next(iter(piece.values())).numel()
                if offset + n <= cut:
                    yield offset, piece
                    continue
                if offset < cut:
                    yield offset, {k: v[:cut - offset] for k, v in piece.items()}
                    rest.append((cut, {k: v[cut - offset:] for k, v in piece.items()}))
                else:
                    rest.append((offset, piece))
                return

        def host_pieces() -> Iterator[StateChunk]:
            for offset, piece in itertools.chain(rest, it):       # streamed: one piece at a time
                yield offset - cut, piece
        self.device.load_state_chunks(g, step, device_pieces())
        self.host.load_state_chunks(g, step, host_pieces())
