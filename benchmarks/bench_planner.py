"""Is the planner's choice never worse than the naive one? For each model size under a host-memory cap, every
config that the memory model says fits is trained, and the planned config must run (its peak RSS under the
cap) and be at least as fast as the rest, within ``--tolerance``.

Two measurements per size:
1. ``--rounds`` rounds of fresh processes, one per config, interleaved with the order reversed every other
   round: peak RSS against the cap, and step times paired by round.
2. The speed verdict, paired by step: for each other config one process builds the planned engine and the
   other one (same model, seed and batch) and alternates their steps in ABBA order, ``--pair-steps`` times
   or, for fast steps, as many as fill about ``--pair-seconds``. Where the planned config looks slower by more
   than the tolerance, a second process with the construction order swapped adds twice as many pairs.
   This VM's memory bandwidth drifts by several percent from minute to minute; two steps seconds apart see
   the same machine, so the median of (planned / other) over step pairs measures the configs, not the drift.

    PYTHONPATH=src python benchmarks/bench_planner.py --host-mem 8GiB --rounds 1 --steps 3 --pair-steps 8
    PYTHONPATH=src python benchmarks/bench_planner.py --sizes xs --rounds 1 --steps 2 --pair-steps 2   # a check

Prints one table per size (median seconds per step, ratios to the planned config, peak RSS) and a verdict;
``--json FILE`` keeps the raw numbers. Measured on the CPU: the ranks compute on the host.
"""
from __future__ import annotations

import argparse
import json
import math
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


def _engine(size: str, config: dict):
    """A fresh engine over the size's GPT (seed 0) and its fixed batch."""
    from zero_offload.train.model import GPT
    torch.manual_seed(0)
    cfg = SIZES[size]
    engine = zero_offload.initialize(GPT(cfg), config)
    x = torch.randint(0, cfg.vocab_size, (BASE["train_micro_batch_size_per_gpu"], cfg.block_size))
    return engine, x


def _timed_step(engine, x) -> float:
    t0 = time.perf_counter()
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t0


def _child(size: str, config: dict, steps: int) -> None:
    """Train ``steps`` steps; print {"step_s": median seconds per step after the first, "peak_rss": bytes}."""
    engine, x = _engine(size, config)
    times = [_timed_step(engine, x) for _ in range(steps + 1)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"step_s": statistics.median(times[1:]), "peak_rss": peak}))


def _pair_child(size: str, planned: dict, other: dict, pairs: int) -> None:
    """Both engines in this process, steps alternated A B B A A B ...; print the per-pair times."""
    a, b = _engine(size, planned), _engine(size, other)
    _timed_step(*a), _timed_step(*b)                      # warm-up: first steps allocate
    out = {"planned_s": [], "other_s": []}
    for k in range(pairs):
        first, second = (("planned_s", a), ("other_s", b)) if k % 2 == 0 else (("other_s", b), ("planned_s", a))
        for key, (engine, x) in (first, second):
            out[key].append(_timed_step(engine, x))
    print(json.dumps(out))


def _paired_ratio(size: str, planned: dict, other: dict, pairs: int, tolerance: float) -> float:
    """Median over step pairs of planned / other step time. When the planned config looks slower by more than
    ``tolerance``, twice as many pairs again in a second process that builds the other engine first (so the
    order of construction cancels too), and the median over all pairs."""
    ratios: list[float] = []
    for first_planned, count in ((True, pairs), (False, 2 * pairs)):
        out = (_run(size, json.dumps(planned), json.dumps(other), count) if first_planned else
               _run(size, json.dumps(other), json.dumps(planned), count))
        if "error" in out:
            return float("inf")
        a, b = (out["planned_s"], out["other_s"]) if first_planned else (out["other_s"], out["planned_s"])
        ratios += [p / o for p, o in zip(a, b)]
        if statistics.median(ratios) <= 1 + tolerance:
            break
    return statistics.median(ratios)


def _run(*args) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--host-mem", default="8GiB", help="host-memory cap the plan must fit (default 8GiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per fresh-process run (after a warm-up)")
    ap.add_argument("--pair-steps", type=int, default=8, help="step pairs per planned-vs-other process, at least")
    ap.add_argument("--pair-seconds", type=float, default=30.0,
                    help="more pairs for fast steps: enough to take about this long (small sizes are noisier)")
    ap.add_argument("--tolerance", type=float, default=0.03, help="noise allowed in the verdict (default 3 %%)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        size, *configs, count = args.child
        (_child if len(configs) == 1 else _pair_child)(size, *map(json.loads, configs), int(count))
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
                out = _run(size, json.dumps(raw), args.steps)
                if "error" in out:
                    times[name].append(float("inf"))
                    print(f"  {size} {name}: failed: {out['error']}")
                    continue
                times[name].append(out["step_s"])
                peaks[name] = max(peaks.get(name, 0), out["peak_rss"])
        med = {n: statistics.median(t) for n, t in times.items()}
        planned = med[result.name]
        # Paired by round (each round runs every config back to back): drift between rounds cancels.
        by_round = {n: statistics.median(p / o for p, o in zip(times[result.name], t)) for n, t in times.items()}
        # Paired by step, planned and other in one process: the verdict.
        by_step = {result.name: 1.0}
        pairs = max(args.pair_steps, math.ceil(args.pair_seconds / (2 * planned)))
        for name, raw in runs:
            if name != result.name and med[name] != float("inf"):
                by_step[name] = _paired_ratio(size, dict(runs)[result.name], raw, pairs, args.tolerance)
        print(f"\n{size}: {count_parameters(SIZES[size]).total / 1e6:.1f}M parameters, "
              f"planned {result.name!r}, host cap {fmt_bytes(cap)}")
        for name, _ in runs:
            mark = "*" if name == result.name else " "
            print(f" {mark} {name:38s} {med[name] * 1e3:9.1f} ms/step  x{med[name] / planned:5.2f}  "
                  f"planned/this by round x{by_round[name]:5.2f}, by step x{by_step.get(name, float('nan')):5.2f}"
                  f"  peak RSS {fmt_bytes(peaks.get(name, 0))}")
        good = max(by_step.values()) <= 1 + args.tolerance and peaks.get(result.name, cap + 1) <= cap
        ok &= good
        print(f"  verdict: {'planned is the fastest (within tolerance) and under the cap' if good else 'NOT'}")
        report[size] = {"planned": result.name, "pairs": pairs, "ms_per_step": {n: t * 1e3 for n, t in med.items()},
                        "rounds_ms": {n: [x * 1e3 for x in t] for n, t in times.items()},
                        "planned_over_this_by_round": by_round, "planned_over_this_by_step": by_step,
                        "peak_rss": peaks, "ok": good}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
