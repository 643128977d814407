"""The pinned host staging an offloaded gradient partition holds under gradient accumulation, and the host thread
that empties it.

Under gradient accumulation an offloaded stage-2/3 partition is fp32 on the host, and a reduced gradient piece (a
stage-2 bucket's share of this rank's partition, or a stage-3 unit's reduce-scattered shard) arrives in the
communication/training dtype on the device. From the second micro-step on the piece is added to what earlier
micro-steps left there; on the first it is converted into the partition. Either way it is copied down as it is
(16-bit bytes over PCIe, no conversion on the copy stream) into a pinned staging slot, and the partition's
`zero_offload.runtime.host_thread.HostThread` waits for that copy's event and adds (or converts) it into the partition
(`zero.grad_partition.GradPartition`). The backward hook only issues the copy.

The pool is double-buffered: `STAGING_SLOTS` = 2 slots, each the largest piece the partition can receive, so a
piece goes down whole while the worker adds the previous one; the hook waits only when the piece two behind has
not been added yet. It is allocated once per partition and never grows with the number of micro-steps.
DeepSpeed's offloaded stage 2 copies each reduced bucket into fixed pinned buffers and accumulates on the CPU
(``async_accumulate_grad_in_cpu_via_gpu``); FSDP2's CPU offload copies each reduce-scattered shard down whole.

This module is the one place that sizes that pool: the engine allocates it with `staging_shape`, and the memory
model (`zero_offload.estimate`) counts it with the same function, as the line ``grad_staging``.
"""
from __future__ import annotations

__all__ = ["STAGING_SLOTS", "STAGING_FORMULA", "staging_shape", "uses_grad_staging"]

STAGING_SLOTS = 2
STAGING_FORMULA = ("gas > 1: 2 pinned slots x the largest piece per offloaded partition (stage 2: min(bucket, P); "
                   "stage 3: the largest unit shard) x the reduced dtype's bytes")


def uses_grad_staging(stage: int, offloaded: bool, gradient_accumulation: int) -> bool:
    """Whether a gradient partition holds the staging pool from the start: host partitions (optimizer or stage-3
    parameters offloaded) at stage >= 2 that accumulate over more than one micro-step (stages 0 and 1 overwrite
    at the boundary; with one micro-step per step a piece is copied straight into a partition of its own dtype).
    A partition without it allocates the same pool at a second backward before a step."""
    return offloaded and stage >= 2 and gradient_accumulation > 1


def staging_shape(piece_numel: int, element_bytes: int, slots: int = STAGING_SLOTS) -> tuple[int, int]:
    """(slot count, bytes per slot) of the pinned staging of an offloaded partition whose largest reduced piece is
    ``piece_numel`` elements of ``element_bytes`` bytes (the reduced dtype: the communication dtype, else the
    training dtype): ``slots`` slots of one whole piece each, rounded up to 64 bytes.

    Raises:
        ValueError: ``slots`` < 1, ``piece_numel`` < 0 or ``element_bytes`` < 1.
    """
    if slots < 1 or piece_numel < 0 or element_bytes < 1:
        raise ValueError(f"grad staging needs slots >= 1, piece_numel >= 0 and element_bytes >= 1, got {slots}, "
                         f"{piece_numel} and {element_bytes}")
    return slots, -(-max(piece_numel, 1) * element_bytes // 64) * 64
