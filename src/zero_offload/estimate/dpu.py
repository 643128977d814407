"""When the planner turns on the delayed parameter update (DPU, ZeRO-Offload paper arXiv 2101.06840, Sec. 5.2).

With the optimizer offloaded, the host step is exposed unless DPU overlaps it with the next step's forward
and backward. The planner compares two stated estimates per optimizer step:

- host step: the fused kernel streams every parameter of the rank's partition through memory once, reading
  and writing the fp32 master and both moments, reading the 16-bit gradient and writing the 16-bit parameter:
  ``(8 + 4 x moment bytes + 2 x d) bytes/param`` (28 B/param for bf16 with fp32 moments) over the host's
  memory bandwidth;
- device compute: ``6 x N x tokens`` FLOPs (forward and backward; ``8 x N x tokens`` with activation
  checkpointing's recompute) at a sustained FLOP/s.

DPU goes on when the host step is more than `EXPOSED_FRACTION` of the device compute, the issue's target for
the exposed host step.
"""
from __future__ import annotations

import time

import torch

__all__ = ["EXPOSED_FRACTION", "DEFAULT_GPU_FLOPS", "host_step_seconds", "device_step_seconds",
           "measure_host_bandwidth"]

EXPOSED_FRACTION = 0.10
# Sustained bf16 FLOP/s of one GPU in training: about 40 % of an H100's dense bf16 peak (989 TFLOP/s).
DEFAULT_GPU_FLOPS = 4.0e14


def host_step_seconds(params: int, moment_bytes: int, param_bytes: int, host_bandwidth: float) -> float:
    """Seconds of one host Adam step over ``params`` elements at ``host_bandwidth`` bytes/s."""
    return params * (8 + 4 * moment_bytes + 2 * param_bytes) / host_bandwidth


def device_step_seconds(n_params: int, tokens: int, gpu_flops: float, checkpointing: bool) -> float:
    """Seconds of one step's forward and backward of ``tokens`` tokens per rank at ``gpu_flops`` FLOP/s."""
    return (8 if checkpointing else 6) * n_params * tokens / gpu_flops


def measure_host_bandwidth(nbytes: int = 1 << 28, repeats: int = 3) -> float:
    """This machine's memory bandwidth in bytes/s, read + write, from the best of ``repeats`` copies of
    ``nbytes`` with torch's multi-threaded copy (about a tenth of a second)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best
