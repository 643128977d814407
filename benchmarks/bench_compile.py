"""Eager against ``torch.compile`` on this machine (issue 29, item 5): median step time of plain ``torch.optim.AdamW``,
ZeRO-2 with the optimizer offloaded, and ZeRO-3 with both offloads, each eager and compiled (``engine.compile()``,
inductor), one rank, fp32. All six are built and warmed up (compiled) first, then timed in interleaved rounds, as this
VM's speed drifts minute to minute.

    python benchmarks/bench_compile.py --rounds 3 --steps 5
"""
import argparse
import statistics
import time
import warnings

import torch

import zero_offload
from zero_offload.train.model import GPT, GPTConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per path and round")
    p.add_argument("--backend", default="inductor")
    args = p.parse_args()
    shape = GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=256)
    data = torch.randint(0, 4096, (4, 129), generator=torch.Generator().manual_seed(1))
    x, y = data[:, :-1], data[:, 1:]

    def model() -> GPT:
        torch.manual_seed(0)
        return GPT(shape)

    def plain(compiled: bool):
        m = model()
        if compiled:
            m.compile(backend=args.backend)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.01)

        def step():
            m(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
        return step

    def engine(stage: int, compiled: bool):
        zc = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
        if stage == 3:
            zc["offload_param"] = {"device": "cpu"}
        e = zero_offload.initialize(model(), {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zc,
                                              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}})
        if compiled:
            e.compile(backend=args.backend)

        def step():
            e.backward(e(x, y)[1])
            e.step()
        return step

    paths = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for compiled in (False, True):
            tag = "compiled" if compiled else "eager"
            for name, make in ((f"plain AdamW, {tag}", lambda: plain(compiled)),
                               (f"ZeRO-2 + offload, {tag}", lambda: engine(2, compiled)),
                               (f"ZeRO-3 + both offloads, {tag}", lambda: engine(3, compiled))):
                start = time.perf_counter()
                step = make()
                for _ in range(2):
                    step()                      # warm-up: compiles
                paths[name] = step
                print(f"built {name} ({time.perf_counter() - start:.0f} s with warm-up)", flush=True)
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(args.rounds):
        for name, step in paths.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    print(f"GPT {shape.n_layer} layers, hidden {shape.n_embd}, seq {shape.block_size}, micro-batch 4, fp32; "
          f"{args.rounds} interleaved rounds of {args.steps} steps, torch threads {torch.get_num_threads()}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, m in med.items():
        eager = med[name.replace("compiled", "eager")]
        print(f"{name:34s} {1e3 * m:7.1f} ms/step   compiled / eager {eager / m:4.2f}x speed")


if __name__ == "__main__":
    main()
