"""The longest sequence a model trains at on one machine (``zero-offload estimate --longest``).

A binary search over the sequence length, in steps of `STEP` tokens up to `MAX_TOKENS`, finds the longest at which
any plan fits (`zero_offload.estimate.plan`, untimed, at micro-batch 1, accumulation 1, activation checkpointing on,
block inputs in host memory where that helps: the least device memory a step takes). Host memory is counted as the
device is: the optimizer states, the pinned buffers and the checkpoint inputs moved there. The longest is then
planned again with every knob but the sequence free, for its config and predicted tokens/s.

What bounds it today: the logits and their loss (``12 * b*s*V`` bytes for a decoder), and each block's recompute;
sequence-tiled compute and Ulysses sequence parallelism, which lift those bounds, are not in the memory model yet.
"""
from __future__ import annotations

from dataclasses import dataclass

from zero_offload.estimate.memory import ModelShape
from zero_offload.estimate.planner import Plan, plan

__all__ = ["Longest", "longest", "STEP", "MAX_TOKENS"]

STEP = 1024                 # the sequence lengths tried are multiples of this
MAX_TOKENS = 1 << 24        # 16M tokens: beyond what any single machine holds


@dataclass
class Longest:
    """The answer: ``seq_len`` (tokens), and ``plan``, the plan at that length with every other knob free."""
    seq_len: int
    plan: Plan

    def lines(self) -> list[str]:
        t = self.plan.batch.timing if self.plan.batch is not None else None
        speed = f", ~{t.tokens_per_s:,.0f} tokens/s per rank predicted" if t is not None else ""
        return [f"longest sequence that trains: {self.seq_len:,} tokens ({self.plan.name}{speed})",
                self.plan.message()]


def longest(shape: ModelShape, gpus: int, gpu_memory, host_memory, nvme=None, *, config=None,
            **plan_kw) -> Longest | None:
    """The longest multiple of `STEP` tokens ``shape`` trains at on ``gpus`` ranks with this memory (module
    docstring), or None when not even `STEP` tokens fit. ``config`` and ``plan_kw`` (allowances, rates,
    calibration) go to `plan` as they are.

    Raises:
        ValueError: as `plan` does (a bad size or count).
    """
    def fits(seq: int) -> bool:
        return plan(shape, gpus, gpu_memory, host_memory, nvme, micro_batch=1, gradient_accumulation=1,
                    seq_len=seq, activation_checkpointing=True, config=config, timed=False, **plan_kw).fits

    if not fits(STEP):
        return None
    lo, hi = STEP, 2 * STEP                    # lo fits; find an hi that does not, doubling
    while hi <= MAX_TOKENS and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, MAX_TOKENS + STEP)
    while hi - lo > STEP:                      # lo fits, hi does not
        mid = (lo + hi) // 2 // STEP * STEP
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return Longest(lo, plan(shape, gpus, gpu_memory, host_memory, nvme, seq_len=lo, config=config,
                            activation_checkpointing=True, **plan_kw))
