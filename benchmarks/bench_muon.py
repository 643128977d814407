"""Muon under ZeRO (issue 43): the host side of a Muon step against the host Adam step, Newton-Schulz on the CPU, and
the engine's Muon step at stage 2 + offload on 2 ranks against the unpartitioned reference step.

Part 1, host side per parameter. On one partition of ``--numel`` fp32 elements (a 16-bit gradient in): the
partition's Muon work (the gradient widened and scaled, momentum and Nesterov; then decay and the update added to the
masters) as torch's ops (`zero_offload.optim.muon.momentum_step`, ``mul_``, ``add_``) and as the native passes
(`zero_offload.optim.muon_pass`), against one step of the fused host Adam (`zero_offload.optim.cpu_adam.CPUAdam`)
and torch's ``AdamW(foreach=True)``; ``--rounds`` rounds, the four interleaved in each round, medians in
parameters/s.

Part 2, Newton-Schulz on the CPU: `zero_offload.optim.muon.orthogonalize` of n x n and 4n x n matrices (``--ns-sizes``;
768 is GPT-2 124M's attention projection and MLP), ``gram`` and ``standard`` in the dtype the CPU gets (`ns_dtype`)
and in fp32; seconds per matrix, and GFLOP/s against `ns_flops`.

Part 3, the step on 2 ranks. A GPT (``--n-layer`` x ``--n-embd``, vocabulary 4096) trained by the engine, type Muon,
ZeRO stage 2 with ``offload_optimizer.device`` "cpu", on 2 gloo ranks of one thread each; beside it, in the same run,
DeepSpeed's ``MuonWithAuxAdam`` (torch AdamW for the Adam half) on one process of 2 threads over the same model and
global batch. Timed: the optimizer step alone (the engine's boundary ``step``, which includes the owners' exchanges
and ZeRO-2's norm and all-gather, and inside it the partition optimizer's own ``step``, the Muon step proper; the
reference's ``optimizer.step``), median of ``--steps`` after one warm-up step (slowest rank), rounds interleaved.

    python benchmarks/bench_muon.py --json runs/bench_muon.json
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from json_result import emit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def host_side(numel: int, rounds: int) -> dict:
    from zero_offload.optim.cpu_adam import CPUAdam
    from zero_offload.optim.muon import MuonRule, momentum_step
    from zero_offload.optim.muon_pass import momentum_pass, update_pass
    torch.manual_seed(0)
    grad16 = torch.randn(numel).bfloat16()
    master = torch.randn(numel)
    momentum = torch.zeros(numel)
    rule = MuonRule(momentum=0.95)
    adam_master = master.clone()
    adam = CPUAdam([{"params": [adam_master], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                     "adamw_mode": True, "bias_correction": True}])
    torch_master = master.clone().requires_grad_()
    torch_adam = torch.optim.AdamW([torch_master], lr=1e-3, foreach=True)
    orthogonal = torch.randn(numel)

    def muon_partition_torch():
        update = momentum_step(momentum, grad16.float().mul_(0.5), rule)
        del update
        master.mul_(1 - 1e-3 * 0.01).add_(orthogonal, alpha=-1e-3)

    window = torch.empty(numel)          # the engine's round window, reused (`RoundWindows`)

    def muon_partition_native():
        momentum_pass(momentum, grad16, 0.5, rule, out=window)
        update_pass(master, orthogonal, 1e-3, 0.01)

    def fused_adam():
        adam.step(grads=[[grad16]], grad_scale=0.5)

    def torch_adamw():
        torch_master.grad = grad16.float().mul_(0.5)
        torch_adam.step()

    paths = {"muon_partition_torch": muon_partition_torch, "muon_partition_native": muon_partition_native,
             "fused_host_adam": fused_adam, "torch_adamw_foreach": torch_adamw}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: {"median_s": statistics.median(t), "params_per_s": numel / statistics.median(t)}
            for name, t in times.items()}


def newton_schulz(repeat: int, sizes: tuple[int, ...]) -> dict:
    from zero_offload.optim.muon import MuonRule, ns_dtype, ns_flops, orthogonalize
    import zero_offload.optim.muon as muon
    out = {}
    for n in sizes:
        for shape in ((n, n), (4 * n, n)):
            u = torch.randn(shape)
            for method in ("gram", "standard"):
                rule = MuonRule(ns_method=method)
                dtypes = {ns_dtype(rule, u.device), torch.float32}
                for dtype in sorted(dtypes, key=str):
                    saved = muon.ns_dtype
                    muon.ns_dtype = lambda r, d, dt=dtype: dt
                    try:
                        start = time.perf_counter()
                        for _ in range(repeat):
                            orthogonalize(u, rule)
                        seconds = (time.perf_counter() - start) / repeat
                    finally:
                        muon.ns_dtype = saved
                    out[f"{shape[0]}x{shape[1]} {method} {str(dtype).split('.')[-1]}"] = {
                        "s": seconds, "gflops": ns_flops(shape) / seconds / 1e9}
    return out


def _model(n_layer: int, n_embd: int):
    from zero_offload.presets import GPTConfig
    from zero_offload.train.model import GPT
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=4096, block_size=64, n_layer=n_layer, n_embd=n_embd, n_head=8))


PARAMS = {"lr": 1e-3, "muon_lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}


def _batch(step: int, rows: int):
    g = torch.Generator().manual_seed(step)
    t = torch.randint(0, 4096, (rows, 65), generator=g)
    return t[:, :-1], t[:, 1:]


def _engine_steps(n_layer, n_embd, steps, micro):
    import torch.distributed as dist
    import zero_offload
    torch.set_num_threads(1)
    rank, ws = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "Muon", "params": PARAMS},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine = zero_offload.initialize(_model(n_layer, n_embd), config)
    optimizer, inner = engine.zero.adam, []          # the partition optimizer's own step, timed inside engine.step
    step_of = optimizer.step

    def timed_step(*a, **k):
        start = time.perf_counter()
        step_of(*a, **k)
        inner.append(time.perf_counter() - start)
    optimizer.step = timed_step
    times = []
    for step in range(steps + 1):
        x, y = _batch(step, micro * ws)
        rows = slice(rank * micro, (rank + 1) * micro)
        engine.backward(engine(x[rows], y[rows])[1])
        dist.barrier()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return list(zip(times[1:], inner[1:]))


def _reference_steps(n_layer, n_embd, steps, micro):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from muon_reference import deepspeed_muon
    torch.set_num_threads(2)
    model = _model(n_layer, n_embd)
    opt = deepspeed_muon(PARAMS, model)
    times = []
    with torch._dynamo.config.patch(disable=True):
        for step in range(steps + 1):
            x, y = _batch(step, micro * 2)
            model.zero_grad()
            model(x, y)[1].backward()
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    return times[1:]


def two_ranks(n_layer: int, n_embd: int, steps: int, rounds: int, micro: int) -> dict:
    from dist_utils import run_ranks
    engine, muon, reference = [], [], []
    for _ in range(rounds):
        ranks = run_ranks(_engine_steps, 2, n_layer, n_embd, steps, micro)
        engine += [max(step for step, _ in t) for t in zip(*ranks)]
        muon += [max(inner for _, inner in t) for t in zip(*ranks)]
        reference += _reference_steps(n_layer, n_embd, steps, micro)
    n = sum(p.numel() for p in _model(n_layer, n_embd).parameters())
    e, m, r = statistics.median(engine), statistics.median(muon), statistics.median(reference)
    return {"params": n, "engine_step_s": e, "partition_optimizer_step_s": m, "reference_step_s": r, "ratio": e / r,
            "partition_optimizer_ratio": m / r}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ns-repeat", type=int, default=2)
    p.add_argument("--ns-sizes", type=int, nargs="+", default=[256, 768],
                   help="n of the n x n and 4n x n matrices (bf16 matmul on a CPU without AVX-512 runs at ~0.2-2 "
                        "GFLOP/s: keep them small there)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
                         f"{torch.__version__}",
              "host_side": host_side(a.numel, a.rounds), "newton_schulz": newton_schulz(a.ns_repeat, tuple(a.ns_sizes)),
              "two_ranks": two_ranks(a.n_layer, a.n_embd, a.steps, max(1, a.rounds // 2), a.micro)}
    emit(result, a.json)


if __name__ == "__main__":
    main()
