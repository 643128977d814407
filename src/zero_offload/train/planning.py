"""The main job's config choice: the planner's for this machine without ``--config``; with one, a check that
it fits before any work is done. Also how a preset too large for host memory is built (`init_sharded`)."""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from zero_offload.config import Config
from zero_offload.estimate import estimate_memory, fmt_bytes, plan
from zero_offload.estimate.planner import HEADROOM
from zero_offload.offload.host_limits import cgroup_memory_limit, memlock_limit
from zero_offload.presets import GPTConfig, count_parameters

__all__ = ["Choice", "choose_config", "needs_sharded_init", "peak_flops"]


@dataclass
class Choice:
    raw: dict               # the config dict to train with
    message: str            # what was chosen and why (printed by rank 0)


def _machine(device: torch.device) -> tuple[int, int]:
    """(accelerator bytes per rank or 0, host bytes available to this job now: within the cgroup's limit too)."""
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    limit = cgroup_memory_limit()
    available = psutil.virtual_memory().available
    return gpu, available if limit is None else min(available, limit)


def choose_config(model: GPTConfig, name: str, base: dict, user_config: str | None, world_size: int,
                  device: torch.device, seq_len: int, allow_stale_step: bool = False,
                  allow_bf16_masters: bool = False, allow_bf16_moments: bool = False) -> Choice:
    """The config to train ``model`` with on ``world_size`` ranks of this machine.

    Without ``user_config``: `zero_offload.plan` over ``base`` (the main job's defaults) for this machine's
    accelerator memory and available host memory, exact unless ``allow_stale_step`` (``--allow-stale-step``) lets
    it turn the delayed update on (and ``allow_bf16_masters``, ``--allow-bf16-masters``, bf16 master weights;
    ``allow_bf16_moments``, ``--allow-bf16-moments``, bf16 moments). With
    one: ``base`` is that config, checked against the same memory model.

    Raises:
        ValueError: nothing fits, or the given config does not fit; the message carries the estimate (what
            is needed where, and what this machine has) and the `zero-offload estimate` command to run.
    """
    gpu, host = _machine(device)
    base_config = Config.load(base)
    micro = base_config.batch_sizes(world_size // base_config.sequence_parallel_size).micro_batch_per_gpu
    hint = (f"run `zero-offload estimate --model {name} --seq-len {seq_len} --micro-batch {micro}` "
            f"to see what fits")
    if user_config is None:
        # The main job's model is built with its own checkpointing setting: the plan keeps it.
        result = plan(model, gpus=world_size, gpu_memory=gpu or None, host_memory=host, micro_batch=micro,
                      seq_len=seq_len, config=base, activation_checkpointing=model.activation_checkpointing,
                      allow_stale_step=allow_stale_step, allow_bf16_masters=allow_bf16_masters,
                      allow_bf16_moments=allow_bf16_moments, locked_memory=memlock_limit() if device.type == "cuda" else None)
        if not result.fits:
            raise ValueError(f"model {name} fits nowhere on this machine: {result.message()}; {hint}")
        return Choice(result.config, result.message())
    est = estimate_memory(model, base, world_size, micro_batch=micro, seq_len=seq_len, accelerator=gpu > 0)
    need = est.need()
    if not needs_sharded_init(model, base, world_size, host):
        need["host"] += 4 * count_parameters(model).total   # the fp32 model built on the host first
    short = []
    if gpu and need["device"] > gpu * (1 - HEADROOM):
        short.append(f"{fmt_bytes(need['device'])} of device memory per rank (the device has {fmt_bytes(gpu)})")
    if need["host"] * world_size > host * (1 - HEADROOM):
        short.append(f"{fmt_bytes(need['host'] * world_size)} of host memory for {world_size} rank(s) "
                     f"({fmt_bytes(host)} available)")
    if short:
        side = ({k: est.device.get(k, 0) + est.host.get(k, 0) for k in {*est.device, *est.host}} if not gpu
                else {**est.device, **{f"host {k}": v for k, v in est.host.items()}})
        top = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(side.items(), key=lambda kv: -kv[1])[:5] if v)
        raise ValueError(f"config {user_config} does not fit model {name} on this machine: it needs "
                         f"{' and '.join(short)}; largest per rank: {top}; {hint}")
    return Choice(base, f"config {user_config}: fits ({fmt_bytes(need['device'])} device, "
                        f"{fmt_bytes(need['host'])} host per rank estimated)")


def needs_sharded_init(model: GPTConfig, raw: dict, world_size: int, host_available: int | None = None) -> bool:
    """Build under `init_sharded` (meta, materialised unit by unit) when the config is stage 3 and the whole
    fp32 model on every rank would take more than half the available host memory."""
    if Config.load(raw).zero_optimization.stage != 3:
        return False
    host = psutil.virtual_memory().available if host_available is None else host_available
    return 4 * count_parameters(model).total * world_size > host / 2


# Dense peak TFLOP/s of 16-bit tensor-core matmuls (vendor data sheets; SXM parts), for MFU.
_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0,
                "V100": 125.0, "4090": 165.2, "3090": 71.0}


def peak_flops(device: torch.device) -> float | None:
    """The device's dense 16-bit peak in FLOP/s from its name, or None (a CPU, an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in _PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None
