"""How much pinned host staging an offloaded gradient partition holds under gradient accumulation.

From the second micro-step of an optimizer step on, a reduced gradient piece (a stage-2 bucket's share of this
rank's partition, or a stage-3 unit's shard) cannot be copied straight into the host partition: it is added to
what earlier micro-steps left there. It is copied down into a pinned staging slot first and added once its copy
has landed (`zero.grad_partition.GradPartition`). The staging is a fixed pool allocated once per partition: a
few slots of at most 4 MiB, never more than the partition in fp32; a larger piece goes down in slot-sized
parts. So it never grows with the model, the bucket size or the number of micro-steps (DeepSpeed's offloaded
stage 2 keeps fixed pinned buffers for the same hand-off).

This module is the one place that sizes that pool: the engine allocates it with `staging_shape`, and the memory
model (`zero_offload.estimate`) counts it with the same function, as the line ``grad_staging``.
"""
from __future__ import annotations

__all__ = ["STAGING_SLOTS", "STAGING_SLOT_BYTES", "staging_shape", "uses_grad_staging"]

STAGING_SLOTS, STAGING_SLOT_BYTES = 4, 4 << 20


def uses_grad_staging(stage: int, offloaded: bool, gradient_accumulation: int) -> bool:
    """Whether a gradient partition holds the staging pool from the start: host partitions (optimizer or stage-3
    parameters offloaded) at stage >= 2 that accumulate over more than one micro-step (stages 0 and 1 overwrite
    at the boundary; the first micro-step copies straight into the partition). A partition without it allocates
    the same pool at a second backward before a step."""
    return offloaded and stage >= 2 and gradient_accumulation > 1


def staging_shape(numel: int, slots: int = STAGING_SLOTS, slot_bytes: int = STAGING_SLOT_BYTES) -> tuple[int, int]:
    """(slot count, bytes per slot) of the pinned staging of an offloaded partition of ``numel`` elements: at most
    ``slot_bytes`` per slot (rounded up to 64 bytes), and all slots together at most the partition in fp32.

    Raises:
        ValueError: ``slots`` < 1 or ``slot_bytes`` < 1.
    """
    if slots < 1 or slot_bytes < 1:
        raise ValueError(f"grad staging needs slots and slot bytes >= 1, got {slots} and {slot_bytes}")
    per_slot = min(slot_bytes, -(-max(numel, 1) * 4 // slots))
    return slots, -(-per_slot // 64) * 64
