"""The step model's timeline: the engine's own step, recorded on a small proxy and replayed with a plan's
durations.

The closed-form pieces of `zero_offload.estimate.throughput` say how long each kind of work takes for a plan:
the device's forward and backward of a micro-step, the gradient copies down and the parameter copies up, the
host accumulation and the host Adam step (`Phases`). How they overlap -- what waits for what -- is recorded
from the engine itself, on a proxy with the plan's structure (`Structure`, recorded by
`zero_offload.estimate.proxy_recording`). Each op is given the plan's duration for its kind, in proportion to its
share of the proxy's work of that kind per micro-step or step, and the graph is replayed (`timeline.predict`). The
steady state between the starts of two recorded steps gives the step time, the device's busy and idle time, each
lane's busy time, the critical path and a text timeline (`StepGraph.lines`).

Not modelled: collectives between ranks (the recording is one rank's), stage 3's gathers (the proxy's device is
the host; their cost is `throughput.STAGE3_UNIT_SECONDS` per unit in the compute), NVMe reads and writes as ops of
their own (the optimizer on NVMe is recorded as the host step, whose duration holds the swap I/O: `throughput`).
The proxy's pipeline ends are coarser than a large model's (the last bucket's copy down is 1/16 of a micro-step's,
the last chunk's copy up 1/64 of a step's).
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

from zero_offload.estimate.proxy_recording import (CHUNKS_PER_LAYER, FIRST_UNIT_STEPS, PROXY_LAYERS, Structure,
                                                   recording)
from zero_offload.offload import timeline
from zero_offload.offload.timeline import Op, Timeline

__all__ = ["Structure", "Phases", "StepGraph", "recording", "predict_step", "first_unit_share", "PROXY_LAYERS",
           "CHUNKS_PER_LAYER", "FIRST_UNIT_STEPS"]

BAR_COLUMNS = 60
# Each op kind's letter in the text timeline, and its name.
LETTERS = {"forward": "F", "backward": "B", "host_step": "S", "host_add": "a", "host_save": "k", "h2d": "u",
           "d2h": "d"}
NAMES = {"forward": "forward", "backward": "backward", "host_step": "host step", "host_add": "host accumulation",
         "host_save": "undo copy", "h2d": "copy up", "d2h": "copy down"}


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
        spans: {lane label: [(start s, end s, op kind)]}: each op of the step, clipped to it, in seconds from the
            step's start (kinds as in `LETTERS`; the lanes in the order of ``bars``).
    """
    step_s: float
    compute_s: float
    busy: dict[str, float]
    critical_path: list[tuple[str, float]]
    bars: dict[str, str]
    spans: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)

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
    g = memo[p]          # its containers copied (their items are immutable): a deep copy took most of a plan's time
    return dataclasses.replace(g, busy=dict(g.busy), critical_path=list(g.critical_path), bars=dict(g.bars),
                               spans={k: list(v) for k, v in g.spans.items()})


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
    spans: dict[str, list[tuple[float, float, str]]] = {}
    cols: dict[str, list[dict[str, float]]] = {}
    for op in tl.ops:
        k = kind(op)
        start, end = pred.times[op.id]
        lo, hi = max(start, t0), min(end, t1)
        if k is None or hi <= lo:
            continue
        label = _lane_label(op.lane)
        busy[label] = busy.get(label, 0.0) + hi - lo
        spans.setdefault(label, []).append((lo - t0, hi - t0, k))
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
    return StepGraph(step_s, compute, busy, _path(tl, pred, b.id, t0, kind), bars,
                     {label: sorted(spans[label]) for label in bars})


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
