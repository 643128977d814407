"""The largest GPT-2-shaped model one machine trains, with its plan and predicted MFU (``zero-offload estimate
--largest``).

For each hidden size of `WIDTHS` (128-dimensional heads, GPT-2's vocabulary and a 1024-token context unless
given), a binary search over the layer count, between `ASPECT` ratios of width to depth (GPT-3's and Llama's shapes
lie between), finds the deepest model any plan fits (`zero_offload.estimate.plan`, untimed, at micro-batch 1,
accumulation 1, activation checkpointing on: the least memory a step takes); the largest of those is planned again
with every knob free, and its predicted tokens/s is turned into MFU: 6 x parameters x tokens/s (the usual model
FLOPs, attention and recompute not counted) over the matmul peak the step model assumes (``gpu_flops`` /
`TRAINING_SHARE_OF_MATMUL`, or the calibrated peak).
"""
from __future__ import annotations

from dataclasses import dataclass

from zero_offload.estimate.planner import Plan, plan
from zero_offload.estimate.throughput import TRAINING_SHARE_OF_MATMUL, calibrated
from zero_offload.presets import GPTConfig, count_parameters

__all__ = ["Largest", "largest", "WIDTHS"]

# Hidden sizes tried (GPT-3's and Llama's ladder, 128-dimensional heads).
WIDTHS = (1024, 2048, 2560, 4096, 5120, 6144, 8192, 12288)
# Width over depth: GPT-3 175B is 128, Llama 2 7B 128, GPT-3 2.7B 80, GPT-2 XL 33.
ASPECT = (32, 160)


@dataclass
class Largest:
    """The answer: ``shape`` (a `GPTConfig`), its ``params``, the ``plan`` with every knob free, and ``mfu``
    (None without a timed plan: no accelerator)."""
    shape: GPTConfig
    params: int
    plan: Plan
    mfu: float | None

    def lines(self) -> list[str]:
        s, p = self.shape, self.plan
        out = [f"largest GPT-2-shaped model that trains: {self.params / 1e9:.2f}B parameters (n_layer {s.n_layer}, "
               f"n_embd {s.n_embd}, n_head {s.n_head}, vocabulary {s.vocab_size}, context {s.block_size})",
               f"plan: {p.name}"]
        out += [f"  {k}: {v}" for k, v in p.reasons.items()]
        if self.mfu is not None:
            out.append(f"predicted MFU {self.mfu:.2f} (6 x parameters x tokens/s over the matmul peak)")
        return out


def _shape(width: int, layers: int, vocab: int, context: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, block_size=context, n_layer=layers, n_head=width // 128, n_embd=width,
                     bias=True, activation_checkpointing=True)


def _params(shape: GPTConfig) -> int:
    return count_parameters(shape).total


def largest(gpus: int, gpu_memory, host_memory, nvme=None, *, seq_len: int = 1024, vocab_size: int = 50257,
            config=None, allow_stale_step: bool = False, calibration=None, allow_bf16_masters: bool = False,
            allow_bf16_moments: bool = False, **rates) -> Largest | None:
    """The largest GPT-2-shaped model that trains on ``gpus`` ranks with this memory (see the module docstring),
    or None when not even the shallowest model of the narrowest width fits. ``config``, ``allow_stale_step``,
    ``allow_bf16_masters``, ``allow_bf16_moments``, ``calibration`` and ``rates`` (``gpu_flops``, ``host_adam``,
    ``pcie``, ``nvme_bandwidth``) go to `plan` as they are.

    Raises:
        ValueError: as `plan` does (a bad size or count).
    """
    def fits(width: int, layers: int) -> bool:
        return plan(_shape(width, layers, vocab_size, seq_len), gpus, gpu_memory, host_memory, nvme, micro_batch=1,
                    gradient_accumulation=1, activation_checkpointing=True, config=config, calibration=calibration,
                    allow_stale_step=allow_stale_step, allow_bf16_masters=allow_bf16_masters,
                    allow_bf16_moments=allow_bf16_moments, timed=False,
                    **rates).fits

    best: GPTConfig | None = None
    for width in WIDTHS:
        least, most = max(1, width // ASPECT[1]), width // ASPECT[0]
        if not fits(width, least):
            continue
        lo, hi = least, most                        # lo layers fit, hi + 1 do not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(width, mid) else (lo, mid - 1)
        shape = _shape(width, lo, vocab_size, seq_len)
        if best is None or _params(shape) > _params(best):
            best = shape
    if best is None:
        return None
    chosen = plan(best, gpus, gpu_memory, host_memory, nvme, config=config, calibration=calibration,
                  allow_stale_step=allow_stale_step, allow_bf16_masters=allow_bf16_masters,
                  allow_bf16_moments=allow_bf16_moments, **rates)
    params = _params(best)
    mfu = None
    if chosen.batch is not None and chosen.batch.timing is not None:
        peak = (rates.get("gpu_flops") or calibrated(calibration).gpu_flops) / TRAINING_SHARE_OF_MATMUL
        mfu = 6 * params * chosen.batch.timing.tokens_per_s / peak
    return Largest(best, params, chosen, mfu)
