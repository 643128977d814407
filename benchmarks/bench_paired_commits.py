"""Our engine at two commits, paired: the same `bench_engine.py` run on each source tree in turn, round by round.

    git worktree add /tmp/before <commit>     # then copy the built native libraries (*.so) into its src too
    python benchmarks/bench_paired_commits.py --before /tmp/before --rounds 5 --json /tmp/paired.json

For each host-step policy (plain, delayed update, super_offload, ratio; ZeRO-2, optimizer offloaded to the CPU,
one rank, bf16) every round runs `bench_engine.py --engines ours` once on ``--before``'s ``src`` and once on this
checkout's (or ``--after``'s), in alternating order (memory bandwidth drifts minute to minute here), each in a fresh process. It
reports per policy the median over rounds of (this tree's median step time / the other's) and whether the
losses of every step are bitwise equal: a change that only moves code keeps the ratio near 1 and the losses equal.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLICIES = {
    "plain": {"device": "cpu"},
    "delayed": {"device": "cpu", "delayed_param_update": True, "dpu_warmup_steps": 2},
    "super_offload": {"device": "cpu", "super_offload": True},
    "ratio": {"device": "cpu", "ratio": 0.5},
}


def run(tree: Path, policy: str, args) -> dict:
    """One `bench_engine.py` run of ``policy`` on ``tree``'s sources: its result for our engine at one rank."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        env = dict(os.environ, PYTHONPATH=str(tree / "src"))
        cmd = [sys.executable, str(HERE / "bench_engine.py"), "--engines", "ours", "--world-sizes", "1",
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--zero-extra", json.dumps({"offload_optimizer": POLICIES[policy]}),
               "--json", str(out)]
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        results = json.loads(out.read_text())
    rows = results["results"] if isinstance(results, dict) else results
    return next(r for r in rows if r.get("engine") == "ours")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a checkout (git worktree) of the commit to compare with")
    ap.add_argument("--after", default=str(HERE.parent), help="the checkout to measure (default: this one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    report = {}
    for policy in args.policies.split(","):
        ratios, bitwise = [], True
        for k in range(args.rounds):
            order = ["before", "after"] if k % 2 == 0 else ["after", "before"]
            got = {name: run(trees[name], policy, args) for name in order}
            ratios.append(got["after"]["step_s"] / got["before"]["step_s"])
            bitwise &= got["after"]["losses"] == got["before"]["losses"]
            print(f"{policy} round {k}: after/before {ratios[-1]:.3f}, losses equal {bitwise}", flush=True)
        report[policy] = {"median_ratio": statistics.median(ratios), "ratios": ratios, "losses_bitwise": bitwise}
        print(f"{policy}: median ratio {report[policy]['median_ratio']:.3f}, losses bitwise {bitwise}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
