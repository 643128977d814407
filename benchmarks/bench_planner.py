"""Is the planner's choice never worse than the naive one? For each model size under a host-memory cap, every
config that the memory model says fits is trained side by side (interleaved per round, each run in a fresh
process), and the planned config must run (its peak RSS under the cap) and be at least as fast as the rest:
the median over rounds of (planned / other) step time, paired by round, within ``--tolerance`` of 1.

    PYTHONPATH=src python benchmarks/bench_planner.py --host-mem 8GiB --rounds 3 --steps 20
    PYTHONPATH=src python benchmarks/bench_planner.py --sizes xs --rounds 1 --steps 2    # a quick check

Prints one table per size (median seconds per step, ratio to the planned config, peak RSS) and a verdict;
``--json FILE`` keeps the raw numbers. Measured on the CPU: the ranks compute on the host.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

import zero_offload
from zero_offload.estimate import fmt_bytes, parse_bytes, plan
from zero_offload.presets import GPTConfig, count_parameters

SIZES = {   # four GPT shapes, from about 4M to about 120M parameters
    "xs": GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=256),
    "s": GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512),
    "m": GPTConfig(vocab_size=16384, block_size=128, n_layer=8, n_head=12, n_embd=768),
    "l": GPTConfig(vocab_size=32768, block_size=128, n_layer=12, n_head=16, n_embd=1024),
}
BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}


def _child(size: str, config: dict, steps: int) -> None:
    """Train ``steps`` steps; print {"step_s": median seconds per step after the first, "peak_rss": bytes}."""
    from zero_offload.train.model import GPT
    torch.manual_seed(0)
    cfg = SIZES[size]
    engine = zero_offload.initialize(GPT(cfg), config)
    x = torch.randint(0, cfg.vocab_size, (BASE["train_micro_batch_size_per_gpu"], cfg.block_size))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"step_s": statistics.median(times[1:]), "peak_rss": peak}))


def _run(size: str, config: dict, steps: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", size, json.dumps(config), str(steps)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--host-mem", default="8GiB", help="host-memory cap the plan must fit (default 8GiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--tolerance", type=float, default=0.03, help="noise allowed in the verdict (default 3 %%)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child[0], json.loads(args.child[1]), int(args.child[2]))
        return 0
    cap = parse_bytes(args.host_mem, "--host-mem")
    report, ok = {}, True
    for size in args.sizes.split(","):
        result = plan(SIZES[size], gpus=1, gpu_memory=None, host_memory=cap, config=BASE)
        if not result.fits:
            print(f"{size}: {result.message()}")
            ok = False
            continue
        seen, runs = set(), []
        for c in result.rows:      # one run per distinct stage x offload that fits
            if c.fits and c.name.split(",")[0] not in seen:
                seen.add(c.name.split(",")[0])
                raw = {**BASE, "zero_optimization": {**BASE["zero_optimization"], **c.zero}}
                runs.append((c.name, raw))
        times: dict[str, list[float]] = {name: [] for name, _ in runs}
        peaks: dict[str, int] = {}
        for r in range(args.rounds):
            order = runs if r % 2 == 0 else runs[::-1]     # interleaved, alternating order per round
            for name, raw in order:
                out = _run(size, raw, args.steps)
                if "error" in out:
                    times[name].append(float("inf"))
                    print(f"  {size} {name}: failed: {out['error']}")
                    continue
                times[name].append(out["step_s"])
                peaks[name] = max(peaks.get(name, 0), out["peak_rss"])
        med = {n: statistics.median(t) for n, t in times.items()}
        planned = med[result.name]
        # Paired by round (each round runs every config back to back): drift of the machine between rounds
        # cancels in the ratio, which the ratio of medians does not do.
        paired = {n: statistics.median(p / o for p, o in zip(times[result.name], t)) for n, t in times.items()}
        print(f"\n{size}: {count_parameters(SIZES[size]).total / 1e6:.1f}M parameters, "
              f"planned {result.name!r}, host cap {fmt_bytes(cap)}")
        for name, _ in runs:
            mark = "*" if name == result.name else " "
            print(f" {mark} {name:38s} {med[name] * 1e3:9.1f} ms/step  x{med[name] / planned:5.2f}  "
                  f"planned/this per round x{paired[name]:5.2f}  peak RSS {fmt_bytes(peaks.get(name, 0))}")
        good = max(paired.values()) <= 1 + args.tolerance and peaks.get(result.name, cap + 1) <= cap
        ok &= good
        print(f"  verdict: {'planned is the fastest (within tolerance) and under the cap' if good else 'NOT'}")
        report[size] = {"planned": result.name, "ms_per_step": {n: t * 1e3 for n, t in med.items()},
                        "rounds_ms": {n: [x * 1e3 for x in t] for n, t in times.items()},
                        "planned_over_this_paired": paired, "peak_rss": peaks, "ok": good}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
