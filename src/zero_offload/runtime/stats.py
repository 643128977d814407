"""`StepStats`: what one optimizer step moved and waited for, counted by the parts that do the work.

The engine reads each part's running counters at every step boundary (`zero_offload.engine.Engine.stats`),
so tests, the progress bar and `benchmarks/gpu_validate.py` see the same numbers without reaching into the
ZeRO optimizers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["StepStats"]


@dataclass(frozen=True)
class StepStats:
    """Counts over one optimizer step (its micro-steps and boundary), on this rank.

    Attributes:
        gathers: parameter all-gathers issued (stage 3: one per unit fetched; stages 1-2: one per param group
            after the step).
        reductions: gradient reductions launched (a bucket's reduce or all-reduce; a stage-3 unit's
            reduce-scatter).
        bytes_down: bytes copied from the device to host memory (gradients to the host partition).
        bytes_up: bytes copied from host memory to the device (updated parameters, stage-3 host shards).
        host_syncs: times the host blocked on a device copy's event (0 without an accelerator).
        regathers: stage-3 units gathered again because backward read a parameter autograd had saved after
            the unit's release (a parameter used outside its module; counted in ``gathers`` too).
    """
    gathers: int = 0
    reductions: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    host_syncs: int = 0
    regathers: int = 0

    @classmethod
    def between(cls, before: dict[str, int], after: dict[str, int]) -> "StepStats":
        """The counts from running counters read ``before`` and ``after`` a step (missing keys count 0)."""
        return cls(**{f.name: after.get(f.name, 0) - before.get(f.name, 0) for f in fields(cls)})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
