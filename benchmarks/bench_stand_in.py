"""A training step under the stand-in (``import deepspeed`` with ``ZERO_OFFLOAD_AS_DEEPSPEED=1``) against the same
step through ``import zero_offload.deepspeed as deepspeed``, paired: fresh processes, interleaved in each round.

    python benchmarks/bench_stand_in.py --rounds 5 --steps 30 --json /tmp/stand_in.json

Each process builds the ``tiny`` GPT preset, ``deepspeed.initialize``s it at ZeRO stage 2 with the optimizer
offloaded (AdamW), trains ``--steps`` steps on random tokens and reports the median step seconds after 5 warm-up
steps, and its start-up seconds (interpreter start to the first step: the hook, the imports, the engine). The
report gives each side's median over rounds, the ratio stand-in / direct, and the spread of the direct side
across rounds (what "within noise" is measured against).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from json_result import emit

CHILD = r"""
import json, statistics, sys, time
t0 = time.perf_counter()
if sys.argv[1] == "stand-in":
    import deepspeed
    assert "zero_offload" in deepspeed.__file__, deepspeed.__file__
else:
    import zero_offload.deepspeed as deepspeed
import torch
from zero_offload.presets import PRESETS
from zero_offload.train.model import GPT
torch.manual_seed(0)
torch.set_num_threads(1)
cfg = PRESETS["tiny"]
model = GPT(cfg)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
g = torch.Generator().manual_seed(1)
steps, times, start = int(sys.argv[2]), [], None
for i in range(steps):
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
    t = time.perf_counter()
    start = start or t
    loss = engine(x[:, :-1], x[:, 1:])[1]
    engine.backward(loss)
    engine.step()
    times.append(time.perf_counter() - t)
print(json.dumps({"step_s": statistics.median(times[5:]), "startup_s": start - t0, "loss": float(loss)}))
"""
SIDES = ("direct", "stand-in")


def run(side: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ZERO_OFFLOAD_AS_DEEPSPEED"}
    if side == "stand-in":
        env["ZERO_OFFLOAD_AS_DEEPSPEED"] = "1"
    done = subprocess.run([sys.executable, "-c", CHILD, side, str(steps)], capture_output=True, text=True, env=env,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    got = {side: [] for side in SIDES}
    for k in range(args.rounds):
        for side in (SIDES if k % 2 == 0 else SIDES[::-1]):     # interleaved, alternating which goes first
            got[side].append(run(side, args.steps))
            print(f"round {k} {side:>8}: step {got[side][-1]['step_s'] * 1e3:.1f} ms, "
                  f"start-up {got[side][-1]['startup_s']:.2f} s", flush=True)
    med = {side: {key: statistics.median(r[key] for r in got[side]) for key in ("step_s", "startup_s")}
           for side in SIDES}
    direct = [r["step_s"] for r in got["direct"]]
    emit({"rounds": args.rounds, "steps": args.steps, "median": med,
          "ratio_step": med["stand-in"]["step_s"] / med["direct"]["step_s"],
          "ratio_startup": med["stand-in"]["startup_s"] / med["direct"]["startup_s"],
          "direct_step_spread": (max(direct) - min(direct)) / med["direct"]["step_s"],
          "same_losses": all(a["loss"] == b["loss"] for a, b in zip(got["direct"], got["stand-in"]))}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
