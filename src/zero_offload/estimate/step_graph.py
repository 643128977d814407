"""The step model's timeline: the engine's own step, recorded on a small proxy and replayed with a plan's
durations.

The closed-form pieces of `zero_offload.estimate.throughput` say how long each kind of work takes for a plan:
the device's forward and backward of a micro-step, the gradient copies down and the parameter copies up, the
host accumulation and the host Adam step (`Phases`). How they overlap -- what waits for what -- is recorded
from the engine itself: a proxy of `PROXY_LAYERS` linear layers trains under simulated streams
(`zero_offload.offload.simulated.forced`) with the plan's structure (`Structure`: stage, parameter offload,
delayed update, accumulation, precision, super_offload), one gradient bucket and `CHUNKS_PER_LAYER` host-step
chunks per layer, while `zero_offload.offload.timeline` records every op with what it waited for. Each op is
given the plan's duration for its kind, in proportion to its share of the proxy's work of that kind per
micro-step or step, and the graph is replayed (`timeline.predict`). The steady state between the starts of two
recorded steps gives the step time, the device's busy and idle time, each lane's busy time, the critical path
and a text timeline (`StepGraph.lines`).

A structure is recorded once per process (0.05-1.3 s on a 2-core host). The proxy trains on the CPU, where the
streams are simulated: on a machine with CUDA, and inside a distributed job (``torch.distributed`` initialised, or
``WORLD_SIZE`` > 1), the recording runs in a one-rank subprocess that sees no GPU.

Not modelled: collectives between ranks (the recording is one rank's), stage 3's gathers (the proxy's device is
the host; their cost is `throughput.STAGE3_UNIT_SECONDS` per unit in the compute), NVMe reads and writes as ops of
their own (the optimizer on NVMe is recorded as the host step, whose duration holds the swap I/O: `throughput`).
The proxy's pipeline ends are coarser than a large model's (the last bucket's copy down is 1/16 of a micro-step's,
the last chunk's copy up 1/64 of a step's).
"""
from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import warnings
import weakref
from dataclasses import asdict, dataclass

import torch

from zero_offload.offload import simulated, timeline
from zero_offload.offload.timeline import Op, Timeline

__all__ = ["Structure", "Phases", "StepGraph", "recording", "predict_step", "first_unit_share", "PROXY_LAYERS",
           "CHUNKS_PER_LAYER", "FIRST_UNIT_STEPS"]

# 16 layers, one bucket each: the last copy down after backward is 1/16 of a micro-step's copies down.
PROXY_LAYERS = 16
PROXY_WIDTH = 96
# The first unit's share is rounded to 1/16, and below 3/32 the bare proxy stands for it (its own first layer, 1/16,
# lands last): GPT-2 124M's tied embedding (31 %) is recorded as 5/16, GPT-2 XL's (5.2 %) and the 10B's (2.0 %) by
# the bare proxy. One recording per rounded share and structure: few shares, few recordings.
FIRST_UNIT_STEPS = 16
# 4 chunks per layer: the 10B GPT-2 has ~12 (613 chunks of 16M elements over 50 blocks); the copy up of the last
# chunk after the host step is then 1/32 of the copies up, not 1/613 (a slight overestimate without the delayed
# update).
CHUNKS_PER_LAYER = 4
WARMUP_STEPS = 2
RECORDED_STEPS = 3
BAR_COLUMNS = 60
# Each op kind's letter in the text timeline, and its name.
LETTERS = {"forward": "F", "backward": "B", "host_step": "S", "host_add": "a", "host_save": "k", "h2d": "u",
           "d2h": "d"}
NAMES = {"forward": "forward", "backward": "backward", "host_step": "host step", "host_add": "host accumulation",
         "host_save": "undo copy", "h2d": "copy up", "d2h": "copy down"}


@dataclass(frozen=True)
class Structure:
    """What shapes a step's graph (the plan's config, less its sizes).

    Attributes:
        stage: ZeRO stage (the optimizer offloaded to the host).
        offload_param: stage 3's parameter shards on the host.
        delayed: the delayed parameter update.
        accumulates: more than one micro-step per optimizer step.
        fp32: fp32 training (else bf16).
        speculative: super_offload's speculative host step during the boundary backward.
        speculated: the share of each partition it speculates (``super_offload_fraction``; below 1 in place
            after undo copies, `zero_offload.hoststep.banks`).
        first_unit: the share of the parameters in the model's first unit (a language model's input embedding,
            tied to its head in GPT-2), whose gradient is the last that backward completes; a multiple of
            1/`FIRST_UNIT_STEPS` (`first_unit_share`), 0 for the bare proxy of equal layers (its first, 1/16,
            lands last).
        grads_on_device: the gradient partition stays on the device and the host step pulls it down chunk by
            chunk (``offload_optimizer.gradients_on_device``): the copies down belong to the step, not to each
            micro-step.
    """
    stage: int
    offload_param: bool
    delayed: bool
    accumulates: bool
    fp32: bool
    speculative: bool = False
    speculated: float = 1.0
    first_unit: float = 0.0
    grads_on_device: bool = False


@dataclass(frozen=True)
class Phases:
    """A plan's seconds for each kind of work of one rank (`zero_offload.estimate.batching` fills them).

    Attributes:
        forward_s, backward_s: device compute of one micro-step (backward with any recompute).
        down_s: gradient copies down of one micro-step (with the gradients on the device: of one step);
            up_s: parameter copies up of one step.
        add_s: host accumulation of one micro-step; host_s: the host Adam step.
        gas: micro-steps per optimizer step.
        save_s: super_offload below fraction 1: the undo copies of the whole partition's state (those of the
            speculated share are recorded).
    """
    forward_s: float
    backward_s: float
    down_s: float
    up_s: float
    add_s: float
    host_s: float
    gas: int = 1
    save_s: float = 0.0


@dataclass
class StepGraph:
    """One replayed step.

    Attributes:
        step_s: seconds between the starts of two steps (steady state); compute_s: the device's compute in it.
        busy: {lane label: busy seconds in the step}.
        critical_path: [(what, seconds)] in order, consecutive ops of one kind and lane merged.
        bars: {lane label: one letter per `BAR_COLUMNS`-th of the step (`LETTERS`; "." idle)}.
    """
    step_s: float
    compute_s: float
    busy: dict[str, float]
    critical_path: list[tuple[str, float]]
    bars: dict[str, str]

    @property
    def idle_s(self) -> float:
        """Seconds the device waits in a step."""
        return max(0.0, self.step_s - self.compute_s)

    @property
    def idle_share(self) -> float:
        """The device's idle share of the step (0 to 1)."""
        return self.idle_s / self.step_s if self.step_s > 0 else 0.0

    def lines(self) -> list[str]:
        """The timeline as text: one bar per lane, its busy seconds, then the critical path."""
        width = max(len(k) for k in self.bars)
        out = [f"{k:<{width}} |{bar}| {self.busy[k]:.3f} s" for k, bar in self.bars.items()]
        path = " -> ".join(f"{what} {s:.3f}" for what, s in self.critical_path if s > 0)
        return out + [f"critical path (s): {path}"]


def _lane_label(lane: str) -> str:
    for part, label in (("MainThread", "training thread"), ("zero_offload-host-step", "host step thread"),
                        ("grad-staging", "staging thread"), ("copy-up-issuer", "copy issuer")):
        if part in lane:
            return label
    return {"compute": "device compute", "h2d": "copies up", "d2h": "copies down"}.get(lane, lane)


def _config(s: Structure, layer: int) -> dict:
    zero = {"stage": s.stage, "reduce_bucket_size": layer, "overlap_comm": True,
            "offload_optimizer": {"device": "cpu", "delayed_param_update": s.delayed, "dpu_warmup_steps": 1,
                                  "super_offload": s.speculative,
                                  **({"super_offload_fraction": s.speculated} if s.speculated < 1 else {}),
                                  **({"gradients_on_device": True} if s.grads_on_device else {}),
                                  # as many chunks per layer as a large model's step has
                                  "copy_chunk": -(-layer // CHUNKS_PER_LAYER)}}
    if s.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    if s.stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2 if s.accumulates else 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    if not s.fp32:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _record_here(s: Structure) -> dict:
    """Record the proxy's steps in this process: {"ops": the timeline's ops, "marks": [[first op id, step,
    micro-step]] for each recorded micro-step}. The caller's random state is left as it was, and the proxy
    engine's warnings (a bucket pool growing on its tiny buckets) are not shown."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return _record_proxy(s)


def first_unit_share(shape) -> float:
    """`Structure.first_unit` for a `zero_offload.estimate.shape.ModelShape`: its first unit's share of the
    parameters, rounded to a multiple of 1/`FIRST_UNIT_STEPS` and at most one half; 0 (the bare proxy) below
    1.5/`FIRST_UNIT_STEPS` and for a shape of one unit (a bare parameter count)."""
    if len(shape.units) < 2:           # a bare parameter count: nothing is known of its order
        return 0.0
    share = sum(shape.units[0][2]) / shape.n_params
    if share < 1.5 / FIRST_UNIT_STEPS:
        return 0.0
    return min(0.5, round(share * FIRST_UNIT_STEPS) / FIRST_UNIT_STEPS)


class _Tied(torch.nn.Module):
    """One use of the proxy's tied weight: the input embedding (``x @ weight``, rows mixed by the input; no
    compute op recorded, as for a lookup) or the output layer (``h @ weight.t()``), as GPT-2 ties them."""

    def __init__(self, weight: torch.nn.Parameter, transpose: bool):
        super().__init__()
        self.weight, self.transpose = weight, transpose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.t() if self.transpose else self.weight)


def _proxy(s: Structure, layer: int) -> tuple[torch.nn.Module, dict[str, int], int]:
    """(model, {module name: parameters} for the timeline, input width): `PROXY_LAYERS` equal layers, behind a
    tied embedding holding ``s.first_unit`` of the parameters where that is above 0."""
    blocks = torch.nn.Sequential(*(torch.nn.Linear(PROXY_WIDTH, PROXY_WIDTH) for _ in range(PROXY_LAYERS)))
    if not s.first_unit:
        return blocks, {str(i): layer for i in range(PROXY_LAYERS)}, PROXY_WIDTH
    rows = round(s.first_unit / (1 - s.first_unit) * PROXY_LAYERS * layer / PROXY_WIDTH)
    weight = torch.nn.Parameter(torch.randn(rows, PROXY_WIDTH) / rows ** 0.5)
    model = torch.nn.Sequential()
    model.add_module("embed", _Tied(weight, transpose=False))
    model.add_module("blocks", blocks)
    model.add_module("head", _Tied(weight, transpose=True))
    return model, {**{f"blocks.{i}": layer for i in range(PROXY_LAYERS)}, "head": rows * PROXY_WIDTH}, rows


def _record_proxy(s: Structure) -> dict:
    import zero_offload
    layer = PROXY_WIDTH * PROXY_WIDTH + PROXY_WIDTH
    gen = torch.Generator().manual_seed(0)
    model, sizes, width = _proxy(s, layer)
    dtype = torch.float32 if s.fp32 else torch.bfloat16
    marks: list[list[int]] = []
    with simulated.forced():
        engine = zero_offload.initialize(model, _config(s, layer))
        try:
            def step(tl: Timeline | None, k: int) -> None:
                for j in range(2 if s.accumulates else 1):
                    if tl is not None:
                        marks.append([len(tl.ops), k, j])
                    x = torch.randn(2, width, generator=gen).to(dtype)
                    engine.backward(engine(x).float().square().mean())
                    engine.step()
            for k in range(WARMUP_STEPS):
                step(None, k)
            with timeline.record(model, sizes) as tl:
                for k in range(RECORDED_STEPS):
                    step(tl, k)
        finally:
            engine.close()
    return {"ops": tl.to_list(), "marks": marks}


def _needs_subprocess() -> bool:
    """Whether an engine made here would not be a one-rank CPU engine: CUDA is visible (the engine would take the
    GPU, whose streams are not simulated), or this process is part of a distributed job."""
    import torch.distributed as dist
    return (torch.cuda.is_available() or (dist.is_available() and dist.is_initialized())
            or int(os.environ.get("WORLD_SIZE", "1")) > 1)


@functools.lru_cache(maxsize=None)
def recording(s: Structure) -> tuple[Timeline, tuple[tuple[int, int, int], ...]]:
    """The proxy's recorded steps for ``s``: (timeline, (first op id, step, micro-step) per micro-step), made once
    per process; in a one-rank CPU subprocess where CUDA is visible or inside a distributed job.

    Raises:
        RuntimeError: the subprocess failed (its stderr in the message).
    """
    if _needs_subprocess():
        env = {k: v for k, v in os.environ.items()
               if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env["CUDA_VISIBLE_DEVICES"] = ""
        done = subprocess.run([sys.executable, "-m", "zero_offload.estimate.step_graph", json.dumps(asdict(s))],
                              env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"recording the step graph of {s} failed: {done.stderr[-2000:]}")
        raw = json.loads(done.stdout)
    else:
        raw = _record_here(s)
    return Timeline.from_list(raw["ops"]), tuple(tuple(m) for m in raw["marks"])


def _micro_steps(ops: list[Op], marks) -> dict[int, int]:
    """{op id: micro-step index} for the ops that belong to one micro-step: the training thread's ops and the
    device ops it queued by their place between the marks; another host thread's ops by the op it last waited
    for (a staged add follows the wait on its copy down)."""
    starts = [m[0] for m in marks]
    index = {}
    waited: dict[str, int] = {}
    k = 0
    for op in ops:
        while k + 1 < len(starts) and op.id >= starts[k + 1]:
            k += 1
        own = op.lane in ("host:MainThread", "compute", "d2h")
        if own and op.id >= starts[0]:
            index[op.id] = marks[k][2]
        elif op.lane.startswith("host:"):
            if op.kind == "host_wait" and op.after and op.after[0] in index:
                waited[op.lane] = index[op.after[0]]
            elif op.lane in waited:
                index[op.id] = waited[op.lane]
    return index


def _durations(tl: Timeline, marks, p: Phases, s: Structure):
    """Each op's seconds for ``p``: its share of the proxy's work of its kind per micro-step (forward, backward,
    copies down, host accumulation) or per step (host step, copies up; copies down of gradients kept on the device)
    times the plan's seconds for it; a later micro-step stands for the ``gas - 1`` of the plan. Shares are of the
    proxy's parameters (in bytes for copies), not of the recorded totals: a delayed step launched before the
    recording may add a step's host work."""
    micro = _micro_steps(tl.ops, marks)
    params = sum(o.work for o in tl.ops if o.kind == "forward" and o.id < (marks[1][0] if len(marks) > 1 else
                                                                             len(tl.ops)))
    # The partition the host step pulls down is fp32 under accumulation at stage >= 2 (the proxy has fp32 masters)
    down_bytes = 4 if s.fp32 or (s.grads_on_device and s.accumulates and s.stage >= 2) else 2
    size = {"forward": params, "backward": params, "host_step": params, "host_add": params, "host_save": params,
            "h2d": params * (4 if s.fp32 else 2), "d2h": params * down_bytes}
    per_micro = {"forward": p.forward_s, "backward": p.backward_s, "host_add": p.add_s}
    per_step = {"host_step": p.host_s, "host_save": p.save_s, "h2d": p.up_s}
    (per_step if s.grads_on_device else per_micro)["d2h"] = p.down_s

    def kind(op: Op) -> str | None:
        if op.kind in ("forward", "backward", "host_step", "host_add", "host_save"):
            return op.kind
        return op.lane if op.lane in ("h2d", "d2h") and op.kind == "copy" else None

    def seconds(op: Op) -> float:
        k = kind(op)
        if k is None:
            return 0.0
        if k in per_step:
            return per_step[k] * op.work / size[k]
        later = micro.get(op.id, 0) > 0
        return per_micro[k] * op.work / size[k] * ((p.gas - 1) if later else 1)
    return seconds, kind


_PREDICTED: dict[int, dict[Phases, StepGraph]] = {}   # id(recorded timeline) -> its replays, dropped with it


def predict_step(s: Structure, p: Phases) -> StepGraph:
    """Replay ``s``'s recorded steps with ``p``'s durations and read the steady state between the starts of the
    second and third recorded steps (see the module docstring). A replay is kept for the recording it read (the
    planner asks for the same one for every host size): a copy of it is returned."""
    tl, marks = recording(s)
    memo = _PREDICTED.get(id(tl))
    if memo is None:
        memo = _PREDICTED[id(tl)] = {}
        weakref.finalize(tl, _PREDICTED.pop, id(tl), None)
    if p not in memo:
        memo[p] = _replay(tl, marks, p, s)
    return copy.deepcopy(memo[p])


def _replay(tl: Timeline, marks, p: Phases, s: Structure) -> StepGraph:
    seconds, kind = _durations(tl, marks, p, s)
    pred = timeline.predict(tl, seconds)
    firsts = [m[0] for m in marks if m[2] == 0]
    computes = [o for o in tl.ops if o.lane == "compute"]

    def start_of(step: int) -> Op:
        return next(o for o in computes if o.id >= firsts[step])
    a, b = start_of(1), start_of(2)
    t0, t1 = pred.times[a.id][0], pred.times[b.id][0]
    step_s = t1 - t0
    busy: dict[str, float] = {}
    cols: dict[str, list[dict[str, float]]] = {}
    for op in tl.ops:
        k = kind(op)
        start, end = pred.times[op.id]
        lo, hi = max(start, t0), min(end, t1)
        if k is None or hi <= lo:
            continue
        label = _lane_label(op.lane)
        busy[label] = busy.get(label, 0.0) + hi - lo
        col = cols.setdefault(label, [dict() for _ in range(BAR_COLUMNS)])
        letter = LETTERS.get(k, "?")
        first, last = int((lo - t0) / step_s * BAR_COLUMNS), int((hi - t0) / step_s * BAR_COLUMNS)
        for c in range(first, min(last, BAR_COLUMNS - 1) + 1):
            c_lo, c_hi = t0 + c * step_s / BAR_COLUMNS, t0 + (c + 1) * step_s / BAR_COLUMNS
            share = min(hi, c_hi) - max(lo, c_lo)
            if share > 0:
                col[c][letter] = col[c].get(letter, 0.0) + share
    order = ["device compute", "copies down", "copies up", "training thread", "staging thread",
             "host step thread", "copy issuer"]
    bars = {label: "".join(max(c, key=c.get) if c else "." for c in cols[label])
            for label in sorted(cols, key=lambda x: order.index(x) if x in order else len(order))}
    compute = busy.get("device compute", 0.0)
    return StepGraph(step_s, compute, busy, _path(tl, pred, b.id, t0, kind), bars)


def _path(tl: Timeline, pred, end: int, t0: float, kind) -> list[tuple[str, float]]:
    """The chain of ops that set the start of op ``end`` back to ``t0``, as (kind on lane, seconds) runs."""
    chain, node = [], pred.cause.get(end)
    while node is not None and pred.times[node][1] > t0:
        chain.append(node)
        node = pred.cause.get(node)
    runs: list[tuple[str, float]] = []
    for i in reversed(chain):
        op = tl.ops[i]
        if kind(op) is None:
            continue
        start, end_s = pred.times[i]
        what = NAMES[kind(op)] + (f" ({_lane_label(op.lane)})" if op.lane.startswith("host:") else "")
        took = end_s - max(start, t0)
        if runs and runs[-1][0] == what:
            runs[-1] = (what, runs[-1][1] + took)
        else:
            runs.append((what, took))
    return runs


if __name__ == "__main__":                     # the one-rank CPU recording of `recording`
    print(json.dumps(_record_here(Structure(**json.loads(sys.argv[1])))))
