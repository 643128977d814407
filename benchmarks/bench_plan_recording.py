"""The planner's cold time where the step model's proxy records in a subprocess, at two commits, paired.

    git worktree add /tmp/before <commit>     # then copy the built native libraries (*.so) into its src too
    python benchmarks/bench_plan_recording.py --before /tmp/before --rounds 2 --json /tmp/plan_recording.json

On a machine with CUDA, and in every rank of a distributed job, the proxy of `zero_offload.estimate.step_graph`
trains in a one-rank CPU subprocess. Each round runs, in fresh processes and alternating order, ``plan(--model,
gpu_memory=80GB)`` on ``--before``'s ``src`` and on this checkout's (or ``--after``'s) with ``WORLD_SIZE=2`` (so
the recordings take the subprocess path on this CPU-only host), and ``--in-process`` adds the same plan without
it. Every plan records afresh (``ZERO_OFFLOAD_RECORDINGS_DIR=off``: none read from disk). It reports the median
seconds per tree and path, the ratio after / before, and whether both trees chose the same row with the same
predicted tokens/s (the recordings are the same engine's, so the plan must not move).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD = """
import json, sys, time
import zero_offload
t = time.perf_counter()
p = zero_offload.plan(sys.argv[1], gpus=1, gpu_memory="80GB", host_memory="64GB")
print(json.dumps({"seconds": time.perf_counter() - t, "name": p.name, "tokens_per_s": p.batch.timing.tokens_per_s}))
"""


def run(tree: Path | None, model: str, subprocess_path: bool, **environ: str) -> dict:
    """One plan in a fresh process on ``tree``'s sources (None: the installed package), with ``environ`` set:
    {"seconds", "name", "tokens_per_s"}."""
    env = dict(os.environ, **environ, **({"PYTHONPATH": str(tree / "src")} if tree is not None else {}))
    env.pop("WORLD_SIZE", None)
    if subprocess_path:
        env["WORLD_SIZE"] = "2"         # a rank of a distributed job: the proxy records in a subprocess
    done = subprocess.run([sys.executable, "-c", CHILD, model], env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def compare(got: dict, paths, sides: tuple[str, str], json_path: str | None) -> None:
    """Print, and write to ``json_path`` if given, per path: the median seconds of each side's runs (``got[side,
    path]``: lists of `run` results), the second side's over the first's, and whether every run made the same plan
    (the same row with the same predicted tokens/s)."""
    first, second = sides
    report = {}
    for path in paths:
        med = {s: statistics.median(r["seconds"] for r in got[s, path]) for s in sides}
        same = len({(r["name"], r["tokens_per_s"]) for s in sides for r in got[s, path]}) == 1
        report[path] = {"median_s": med, f"{second}_over_{first}": med[second] / med[first], "same_plan": same,
                        "runs": {s: got[s, path] for s in sides}}
        print(f"{path}: {first} {med[first]:.1f} s, {second} {med[second]:.1f} s, "
              f"{second}/{first} {med[second] / med[first]:.3f}, same plan {same}", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a checkout (git worktree) of the commit to compare with")
    ap.add_argument("--after", default=str(HERE.parent), help="the checkout to measure (default: this one)")
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--in-process", action="store_true", help="also time the plan with the proxy in this process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    paths = {"subprocess": True, **({"in process": False} if args.in_process else {})}
    got: dict[tuple[str, str], list[dict]] = {(t, p): [] for t in trees for p in paths}
    for k in range(args.rounds):
        order = list(trees) if k % 2 == 0 else list(reversed(trees))
        for path, sub in paths.items():
            for tree in order:
                got[tree, path].append(run(trees[tree], args.model, sub, ZERO_OFFLOAD_RECORDINGS_DIR="off"))
                print(f"round {k} {path:>10} {tree:>6}: {got[tree, path][-1]['seconds']:.1f} s", flush=True)
    compare(got, paths, ("before", "after"), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
