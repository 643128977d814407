"""Which source files one optimizer step crosses, in order: a trace for docs/how-a-step-flows.md.

    python benchmarks/step_files.py [--policy super_offload|delayed|plain|ratio] [--stage 2|3]

Trains a small MLP at one rank on the CPU (bf16, optimizer offloaded), then traces the boundary micro-step's
backward and ``engine.step()`` with ``sys.setprofile`` on every thread: each call into a file of
``zero_offload`` is recorded. Prints the files in the order the step first enters them, how many calls each took,
and for each file how many times the step entered it again after leaving it, then every call from one file into
another (caller -> callee): a call from a lower floor back up is a callback. Not timed: the trace slows Python
down.
"""
from __future__ import annotations

import argparse
import sys
import threading
from collections import Counter
from pathlib import Path

import torch

import zero_offload

ROOT = Path(zero_offload.__file__).resolve().parent
EDGES: Counter = Counter()     # (caller's file, callee's file) -> calls, filled by `trace_step`


def config(policy: str, stage: int) -> dict:
    offload = {"device": "cpu", "super_offload": policy == "super_offload",
               "delayed_param_update": policy == "delayed", "dpu_warmup_steps": 0,
               "ratio": 0.5 if policy == "ratio" else 1.0}
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096, "offload_optimizer": offload}}


def trace_step(policy: str, stage: int, with_backward: bool = True) -> list[str]:
    """The zero_offload files of each call during one step (with its boundary backward, or ``engine.step()``
    alone), in call order."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
    engine = zero_offload.initialize(model, config(policy, stage))
    x = torch.randn(2, 64).to(torch.bfloat16)

    def one_step() -> None:
        engine.backward(engine(x).float().square().mean())
        engine.step()
    one_step()
    one_step()
    calls: list[str] = []

    def profile(frame, event, _arg):
        if event == "call":
            path = Path(frame.f_code.co_filename).resolve()
            if ROOT in path.parents:
                calls.append(str(path.relative_to(ROOT)))
                caller = Path(frame.f_back.f_code.co_filename).resolve() if frame.f_back else None
                if caller is not None and ROOT in caller.parents and caller != path:
                    EDGES[(str(caller.relative_to(ROOT)), calls[-1])] += 1
        return None
    loss = engine(x).float().square().mean()
    if not with_backward:
        engine.backward(loss)
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        if with_backward:
            engine.backward(loss)
        engine.step()
        engine.flush_delayed_update()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    engine.close()
    return calls


def returns(calls: list[str]) -> Counter:
    """Per file, how often the step entered it again after it had been left for another file."""
    seen, out, last = set(), Counter(), None
    for f in calls:
        if f != last:
            if f in seen:
                out[f] += 1
            seen.add(f)
            last = f
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="super_offload", choices=["super_offload", "delayed", "plain", "ratio"])
    ap.add_argument("--stage", type=int, default=2, choices=[2, 3])
    ap.add_argument("--step-only", action="store_true", help="trace engine.step() alone, not the boundary backward")
    args = ap.parse_args()
    calls = trace_step(args.policy, args.stage, not args.step_only)
    counts = Counter(calls)
    back = returns(calls)
    order = list(dict.fromkeys(calls))
    back_total = sum(back.values())
    print(f"stage {args.stage}, {args.policy}{' (step only)' if args.step_only else ''}: {len(order)} files, "
          f"{back_total} re-entries")
    for f in order:
        print(f"  {f:40s} {counts[f]:6d} calls, entered again {back[f]:4d} times")
    print("calls between files (caller -> callee: calls):")
    for (a, b), n in sorted(EDGES.items(), key=lambda e: order.index(e[0][0]) if e[0][0] in order else 0):
        print(f"  {a} -> {b}: {n}")


if __name__ == "__main__":
    main()
