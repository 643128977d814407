"""A launch's plan with the step model's recordings on disk against one without, paired in fresh processes.

    python benchmarks/bench_plan_cache.py --rounds 2 --json /tmp/plan_cache.json

Each round makes an empty recordings directory (``ZERO_OFFLOAD_RECORDINGS_DIR``), then times ``plan(--model,
gpu_memory=80GB)`` in a fresh process twice: the first records every structure and keeps it (a first launch),
the second reads them (every later launch of the same engine). Both in this process's path and, with
``WORLD_SIZE=2``, the subprocess path a GPU host and every rank of a distributed job take. Reports the median
seconds of each, the ratio later / first, and whether both chose the same row with the same predicted tokens/s.
"""
from __future__ import annotations

import argparse
import sys
import tempfile

from bench_plan_recording import compare, run

PATHS = {"in process": False, "subprocess": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    got = {(launch, p): [] for p in PATHS for launch in ("first", "later")}
    for k in range(args.rounds):
        for path, sub in PATHS.items():
            with tempfile.TemporaryDirectory(prefix="zo-recordings-") as recordings:
                for launch in ("first", "later"):
                    got[launch, path].append(run(None, args.model, sub, ZERO_OFFLOAD_RECORDINGS_DIR=recordings))
                    print(f"round {k} {path:>10} {launch:>5}: {got[launch, path][-1]['seconds']:.1f} s", flush=True)
    compare(got, PATHS, ("first", "later"), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
