"""The step model's NVMe term against the engine's measured host step with the optimizer states in swap files.

On this machine: `zero_offload.calibrate` measures the host Adam kernel (at the host step's thread count) and the
swap directory's read and write rates (``measure_nvme``); a GPT of ``--n-layer`` x ``--n-embd`` (vocabulary 4096)
then trains at ZeRO stage 2 with ``offload_optimizer.device = nvme`` in ``--precision``, with the sub-groups read
ahead and written behind and without; each step's host step is timed by the engine (``host_step_s``: reads,
kernel, writes; the median of ``--steps`` after a warm-up). Beside each, the step model's prediction of that host
step (`zero_offload.estimate.batching`'s host step: the kernel's bytes at the measured rate, and the swap I/O at the
measured rates, overlapped or in sequence). Each of ``--rounds`` rounds measures the rates again before its runs
(a virtual disk's rates drift minute to minute). Prints JSON: per round the rates and measured / predicted.

    python benchmarks/bench_nvme_step_model.py --nvme-path /tmp/nvme --json runs/bench_nvme_step_model.json
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
from pathlib import Path

import torch

from json_result import emit

VARIANTS = {"pipelined": True, "sequential": False}


def _model(n_layer: int, n_embd: int):
    from zero_offload.presets import GPTConfig
    from zero_offload.train.model import GPT
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=4096, block_size=64, n_layer=n_layer, n_embd=n_embd, n_head=8))


def _config(nvme_path: str, pipelined: bool, precision: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 2, "sub_group_size": 10_000_000,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path,
                                                          "buffer_count": 4, "pipeline_read": pipelined,
                                                          "pipeline_write": pipelined}}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def measured_host_steps(n_layer: int, n_embd: int, config: dict, steps: int) -> list[float]:
    """The engine's own host-step seconds of ``steps`` steps after one warm-up step."""
    import zero_offload
    engine = zero_offload.initialize(_model(n_layer, n_embd), config)
    out = []
    for step in range(steps + 1):
        tokens = torch.randint(0, 4096, (1, 65), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:])[1])
        engine.step()
        out.append(engine.zero.adam.host_step_s)
    engine.close()
    return out[1:]


def predicted_host_step(n_layer: int, n_embd: int, config: dict, rates) -> float:
    from zero_offload.config import Config
    from zero_offload.estimate.batching import _host_step
    from zero_offload.estimate.shape import model_shape
    return _host_step(model_shape(_model(n_layer, n_embd)), Config.load(config), 1, 1, rates)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-path", required=True, help="swap directory (on the drive to measure)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    from zero_offload.calibrate import measure_host_adam, measure_nvme
    from zero_offload.estimate.throughput import Assumptions
    Path(a.nvme_path).mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    params = sum(x.numel() for x in _model(a.n_layer, a.n_embd).parameters())
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
                         f"{torch.__version__}", "params": params, "precision": a.precision, "threads": threads,
              "rounds": []}
    for _ in range(a.rounds):           # the disk's rates drift: measured again beside each round's steps
        nvme = measure_nvme(a.nvme_path)
        rates = dataclasses.replace(Assumptions(), host_adam=measure_host_adam(threads), source="measured here",
                                    **{k.split("_bytes")[0]: v for k, v in nvme.items()})
        row = {"host_adam_params_per_s": rates.host_adam, **nvme}
        for name, pipelined in VARIANTS.items():
            config = _config(a.nvme_path, pipelined, a.precision)
            measured = statistics.median(measured_host_steps(a.n_layer, a.n_embd, config, a.steps))
            predicted = predicted_host_step(a.n_layer, a.n_embd, config, rates)
            row[name] = {"measured_s": measured, "predicted_s": predicted, "ratio": measured / predicted}
        result["rounds"].append(row)
    for name in VARIANTS:
        result[f"{name}_median_ratio"] = statistics.median(r[name]["ratio"] for r in result["rounds"])
    emit(result, a.json)


if __name__ == "__main__":
    main()
