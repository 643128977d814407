"""What the planner's batch choice works with: the knobs it may set (`Knobs`) and one setting of them with its
memory and predicted step (`BatchChoice`); `zero_offload.estimate.batching` makes them."""
from __future__ import annotations

from dataclasses import dataclass, field

from zero_offload.estimate.decoder_activations import SequenceTiles
from zero_offload.estimate.memory import MemoryEstimate
from zero_offload.estimate.throughput import StepTiming

__all__ = ["Knobs", "BatchChoice"]


@dataclass(frozen=True)
class Knobs:
    """What the planner may choose (None) and what is fixed (a value).

    Attributes:
        micro_batch: sequences per micro-batch.
        gradient_accumulation: micro-steps per optimizer step.
        checkpointing: activation checkpointing (None for a shape without a transformer: not modelled).
        delayed_update: ``offload_optimizer.delayed_param_update``.
        super_offload: ``offload_optimizer.super_offload``.
        super_offload_fraction: ``offload_optimizer.super_offload_fraction`` (None: the largest share on the
            `FRACTION_STEP` grid whose undo bank fits, where the full second bank does not).
        ratio: ``offload_optimizer.ratio``.
        choose_checkpointing: whether ``checkpointing`` None means "choose" (a GPT shape) or "the model's own".
        allow_stale_step: the plan may choose the delayed update where ``delayed_update`` is None (it changes what
            is trained: each step's gradient is taken at the parameters before the last step).
        tiles: the sequence-tiled compute the run uses (`SequenceTiles`; None: none), fixed: its memory is the
            memory model's, its recompute the step model's.
    """
    micro_batch: int | None = None
    gradient_accumulation: int | None = None
    checkpointing: bool | None = None
    delayed_update: bool | None = None
    choose_checkpointing: bool = True
    super_offload: bool | None = None
    ratio: float | None = None
    allow_stale_step: bool = False
    super_offload_fraction: float | None = None
    tiles: SequenceTiles | None = None


@dataclass
class BatchChoice:
    """One setting of the knobs for a config, with its memory and predicted step.

    Attributes:
        raw: the config dict with the micro-batch, accumulation, delayed update and super_offload written in.
        micro, gas, checkpointing, delayed, speculative, ratio: the setting (checkpointing None: the model's own;
            speculative: super_offload; ratio: the share of the optimizer state offloaded).
        estimate, short: `estimate_memory` of it and {side: bytes missing} (all 0: it fits).
        timing: the predicted step (None without a throughput model: no accelerator or no sequence length).
        notes: {reason key: why}, for `Plan.reasons`.
        fraction: with super_offload, the share of each partition speculated (``super_offload_fraction``).
        inputs_on_host: the checkpoint inputs wait in host memory (``activation_checkpointing.cpu_checkpointing``).
    """
    raw: dict
    micro: int
    gas: int
    checkpointing: bool | None
    delayed: bool
    speculative: bool
    ratio: float
    estimate: MemoryEstimate
    short: dict[str, int]
    timing: StepTiming | None = None
    notes: dict[str, str] = field(default_factory=dict)
    fraction: float = 1.0
    inputs_on_host: bool = False

    @property
    def fits(self) -> bool:
        return not any(self.short.values())
