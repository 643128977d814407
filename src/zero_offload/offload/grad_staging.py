"""How much pinned host staging an offloaded gradient partition holds under gradient accumulation.

From the second micro-step of an optimizer step on, a reduced gradient piece (a stage-2 bucket's share of this
rank's partition, or a stage-3 unit's shard) cannot be copied straight into the host partition: it is added to
what earlier micro-steps left there. It is copied down into a pinned staging buffer first and added once its
copy has landed (`zero.grad_partition.GradPartition`). The staging is a fixed pool: one buffer the size of the
largest piece per reduction in flight, so it never grows with the model or the number of micro-steps.

This module is the one place that sizes that pool: the engine allocates it with `grad_staging_shape`, and the
memory model (`zero_offload.estimate`) counts it with the same function, as the line ``grad_staging``.
"""
from __future__ import annotations

__all__ = ["STAGING_SLOTS", "grad_staging_shape", "uses_grad_staging"]

# One slot per reduction in flight: the gradient reducer's and stage 3's bound (``max_in_flight`` = 2).
STAGING_SLOTS = 2


def uses_grad_staging(stage: int, offloaded: bool, gradient_accumulation: int) -> bool:
    """Whether a gradient partition needs the staging pool: host partitions (optimizer or stage-3 parameters
    offloaded) at stage >= 2 that accumulate over more than one micro-step (stages 0 and 1 overwrite at the
    boundary; the first micro-step copies straight into the partition)."""
    return offloaded and stage >= 2 and gradient_accumulation > 1


def grad_staging_shape(largest_piece: int, slots: int = STAGING_SLOTS) -> tuple[int, int]:
    """(buffer count, elements per buffer) of the staging pool for reduced pieces of at most ``largest_piece``
    elements (in the communication dtype: bf16/fp16 training moves 2 bytes per element).

    Raises:
        ValueError: ``largest_piece`` < 1 or ``slots`` < 1.
    """
    if largest_piece < 1 or slots < 1:
        raise ValueError(f"grad staging needs pieces and slots >= 1, got {largest_piece} and {slots}")
    return slots, largest_piece
