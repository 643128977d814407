"""The simulated-stream step graph of each host-step policy, in a form two recordings can be compared in.

`record_policy` trains a small MLP at ZeRO stage 2, one rank, bf16, under ``ZERO_OFFLOAD_SIMULATE_STREAMS=1``
with a fixed stream latency, and records one optimizer step after two warm-up steps (a delayed step is
finished before the recording and inside it)
(`zero_offload.offload.timeline`). `canonical` turns the recording into what does not depend on thread timing:
per lane (thread numbers dropped from host lanes), the sequence of its ops (kind, module name, work), and every
dependency edge as (lane, position) -> (lane, position). ``python tests/step_graphs.py`` writes the recordings of
every policy to ``tests/data/step_graphs.json``; tests/test_step_graphs.py compares the code's graphs with it.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

POLICIES = {
    "plain-cpu": {"device": "cpu"},
    "delayed-cpu": {"device": "cpu", "delayed_param_update": True, "dpu_warmup_steps": 1},
    "super_offload-cpu": {"device": "cpu", "super_offload": True},
    "ratio-cpu": {"device": "cpu", "ratio": 0.5},
    "plain-nvme": {"device": "nvme"},
    "super_offload-nvme": {"device": "nvme", "super_offload": True},
    "ratio-nvme": {"device": "nvme", "ratio": 0.5},
    "delayed-cpu-gas2": {"device": "cpu", "delayed_param_update": True, "dpu_warmup_steps": 1},
    "super_offload-cpu-gas2": {"device": "cpu", "super_offload": True},
}
FIXTURE = Path(__file__).parent / "data" / "step_graphs.json"
WIDTH, LAYERS, CHUNK = 64, 3, 1 << 10


def config(policy: str, swap_dir: str, chunk: int = CHUNK) -> dict:
    offload = dict(POLICIES[policy], copy_chunk=chunk)
    if offload["device"] == "nvme":
        offload.update(nvme_path=swap_dir, buffer_count=4)
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "gradient_accumulation_steps": 2 if policy.endswith("gas2") else 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 2048, "overlap_comm": True, "sub_group_size": 2048,
                                  "offload_optimizer": offload}}


def record_policy(policy: str, swap_dir: str, chunk: int = CHUNK) -> list[dict]:
    """The ops of one recorded step of ``policy`` (`Timeline.to_list`), its host step in chunks of ``chunk``
    elements. Call under simulated streams with a fixed ``random_delay``."""
    import zero_offload
    from zero_offload.offload import timeline
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    cfg = config(policy, swap_dir, chunk)
    engine = zero_offload.initialize(model, cfg)
    gas = cfg["gradient_accumulation_steps"]
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        for _ in range(gas):
            x = torch.randn(2, WIDTH, generator=g).to(torch.bfloat16)
            engine.backward(engine(x).float().square().mean())
            engine.step()
    try:
        for _ in range(2):
            step()
        engine.flush_delayed_update()     # nothing in flight when the recording starts, nor when it ends
        with timeline.record(model) as tl:
            step()
            engine.flush_delayed_update()
    finally:
        engine.close()
    return tl.to_list()


def _lane(lane: str) -> str:
    return re.sub(r"_\d+$", "", lane)


def canonical(ops: list[dict]) -> dict:
    """{"lanes": {lane: [[kind, name, work], ...]}, "edges": sorted [[lane, i, lane, j]]}: op j of a lane waits
    for (or was issued after) op i of another (see the module docstring); i is -1 where a host wait waits for a copy:
    the speculation's first waits fall on one copy or another with the stream latency."""
    lanes: dict[str, list] = {}
    where: dict[int, tuple[str, int]] = {}
    for op in ops:
        lane = _lane(op["lane"])
        where[op["id"]] = (lane, len(lanes.setdefault(lane, [])))
        lanes[lane].append([op["kind"], op["name"], op["work"]])
    edges = set()
    kinds = {op["id"]: op["kind"] for op in ops}
    for op in ops:
        for before in [*op["after"], *([op["issued_by"]] if op["issued_by"] is not None else [])]:
            if before in where:
                lane, i = where[before]
                if op["kind"] == "host_wait" and kinds[before] == "copy":
                    i = -1     # which copy of the lane a host thread waits for first may depend on timing
                edges.add((lane, i, *where[op["id"]]))
    return {"lanes": lanes, "edges": sorted(list(e) for e in edges)}


def record_all(swap_dir: str) -> dict:
    """Every policy's canonical graph (sets the simulated streams up itself; for the fixture)."""
    import os
    from zero_offload.offload import simulated
    os.environ[simulated.ENV] = "1"
    simulated.random_delay = lambda: 0.002
    return {p: canonical(record_policy(p, swap_dir)) for p in POLICIES}


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        graphs = record_all(d)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE
    out.write_text(json.dumps(graphs, indent=0, sort_keys=True))
    print({p: sum(len(v) for v in g["lanes"].values()) for p, g in graphs.items()})
