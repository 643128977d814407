"""A step's timeline, recorded on the CPU and replayed with hardware rates.

Under ``ZERO_OFFLOAD_SIMULATE_STREAMS=1`` every asynchronous copy and collective is queued on a simulated
stream and every wait on it is real (`zero_offload.offload.simulated`). Inside ``with record(model) as tl:``
each of them becomes an `Op` of a graph, with what it waited for:

- **host lanes** (one per host thread, ``host:<thread name>``): the host step's chunks (``host_step``, work in
  elements), the staged gradient adds (``host_add``), super_offload's undo copies (``host_save``), and host waits
  on a copy or collective (``host_wait``);
- **device lanes**: ``compute`` (each parameter-owning module's ``forward`` and ``backward``, work in the
  module's parameters), and one lane per simulated stream (``h2d``/``d2h`` copies, collectives; work in bytes).

Edges follow CUDA's rules, as the engine's CUDA path relies on them: a device op starts no earlier than the host
issued it; a copy waits for the compute queued before it (`CudaCopies._copy`); a compute op waits for the copies
the compute stream was made to wait for (``CopyHandle.wait_stream``) since the previous compute op; a host
wait blocks its thread until the op it waits for has ended.

`predict` replays the graph with durations from rates (`Rates`: bf16 FLOP/s, PCIe bytes/s each way, host Adam
parameters/s) and returns the step time, the device's idle share and the critical path: the recorded order
and waits are the engine's, the durations the target machine's. The replay is deterministic, so tests assert
the overlap structure on it (tests/test_timeline.py) without timing anything.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

__all__ = ["Op", "Timeline", "Rates", "Prediction", "record", "current", "predict", "with_chunks_recorded"]

_active: "Timeline | None" = None


def current() -> "Timeline | None":
    """The timeline being recorded, or None (every recording hook is then a no-op)."""
    return _active


def with_chunks_recorded(on_chunk, kind: str):
    """A kernel's ``on_chunk(group, param, lo, hi)`` with each finished chunk first recorded as ``kind`` host work
    while a timeline is being recorded; else ``on_chunk`` itself (None stays None)."""
    tl = current()
    if tl is None:
        return on_chunk

    def chunk(g, param, lo, hi):
        tl.host_work(kind, hi - lo)
        if on_chunk is not None:
            on_chunk(g, param, lo, hi)
    return chunk


@dataclass
class Op:
    """One node of the graph. ``lane``: where it runs (``host:<thread>``, ``compute``, ``h2d``, ``d2h`` or a
    collective stream); ``kind``: forward, backward, copy, collective, host_step, host_add, host_save, host_wait;
    ``work``: parameters (compute), bytes (copies, collectives) or elements (host work); ``after``: ids of the ops
    it waits for; ``issued_by``: the id of the host op it was issued after (None: the host lane's start)."""
    id: int
    lane: str
    kind: str
    work: float = 0.0
    name: str = ""
    after: list[int] = field(default_factory=list)
    issued_by: int | None = None


@dataclass(frozen=True)
class Rates:
    """Rates for `predict`. ``gpu_flops``: sustained FLOP/s; ``tokens``: tokens per micro-batch (compute ops
    cost 2 x parameters x tokens FLOPs forward, twice that backward); ``h2d``/``d2h``: bytes/s; ``host_adam``:
    host step elements/s; ``host_add``: staged add elements/s; ``collective``: bytes/s (0: collectives cost
    nothing, one rank)."""
    gpu_flops: float = 4.0e14
    tokens: int = 8192
    h2d: float = 25e9
    d2h: float = 25e9
    host_adam: float = 1.9e9
    host_add: float = 5.3e9
    collective: float = 0.0


@dataclass
class Prediction:
    """`predict`'s answer: seconds of the step, device busy seconds (compute lane), the idle share of the
    compute lane over the step, each op's (start, end), the critical path (op ids, first to last), and for each
    op the op whose end set its start (None: its lane's start)."""
    step_s: float
    compute_s: float
    idle_share: float
    times: dict[int, tuple[float, float]]
    critical_path: list[int]
    cause: dict[int, int | None] = field(default_factory=dict)


class Timeline:
    """The recorder (see the module docstring). Thread-safe: host threads and simulated streams record into it."""

    def __init__(self):
        self.ops: list[Op] = []
        self.lock = threading.Lock()
        self._last_host: dict[str, int] = {}        # per host lane, its last op
        self._last_compute: int | None = None
        self._compute_waits: list[int] = []         # copies the next compute op waits for
        self._launches: dict[str, int] = {}         # host lane prefix -> the op that launched its next task

    # -- recording ------------------------------------------------------------------------------------------
    def _host_lane(self) -> str:
        return f"host:{threading.current_thread().name}"

    def _add(self, lane: str, kind: str, work: float = 0.0, name: str = "", after=()) -> Op:
        with self.lock:
            host = self._host_lane()
            after = [a for a in after if a is not None]
            for prefix in [p for p in self._launches if lane.startswith(p)]:
                after.append(self._launches.pop(prefix))
            op = Op(len(self.ops), lane, kind, float(work), name, after, self._last_host.get(host))
            self.ops.append(op)
            if lane == host:
                self._last_host[host] = op.id
            return op

    def queued(self, lane: str, kind: str, nbytes: int, after: list[int | None] | None = None) -> int:
        """A copy or collective queued on simulated stream ``lane`` by this host thread: it waits for the compute
        queued so far, or for the ops ``after`` (a `compute_point`). Returns its id."""
        return self._add(lane, kind, nbytes, after=[self._last_compute] if after is None else after).id

    def compute_point(self) -> int | None:
        """The last compute op issued so far (`Copies.compute_point`)."""
        return self._last_compute

    def stream_waits_for(self, lane: str, op_id: int | None) -> None:
        """Simulated stream ``lane`` waits for ``op_id`` before its later work (``downloads_after``)."""
        if op_id is not None:
            self._add(lane, "stream_wait", after=[op_id])

    def compute(self, kind: str, name: str, params: int) -> int:
        """A compute op (a module's forward or backward) issued now; it waits for the copies the compute stream
        was made to wait for since the previous one."""
        with self.lock:
            waits, self._compute_waits = self._compute_waits, []
        op = self._add("compute", kind, params, name, after=waits)
        self._last_compute = op.id
        return op.id

    def compute_waits_for(self, op_id: int | None) -> None:
        """The compute stream was made to wait for ``op_id`` (``wait_stream``)."""
        if op_id is not None:
            with self.lock:
                self._compute_waits.append(op_id)

    def host_wait(self, op_id: int | None) -> None:
        """This host thread blocks until ``op_id`` has ended."""
        if op_id is not None:
            self._add(self._host_lane(), "host_wait", after=[op_id])

    def host_work(self, kind: str, elements: int, after=()) -> None:
        """``elements`` of host work (a host step chunk, a staged add) on this host thread, after the ops ``after``
        too (handed over by another thread)."""
        self._add(self._host_lane(), kind, elements, after=after)

    def last_host_op(self) -> int | None:
        """This host thread's last op."""
        with self.lock:
            return self._last_host.get(self._host_lane())

    def launched(self, thread: str) -> None:
        """This host thread handed a task to `HostThread` ``thread``: that thread's next op starts after this
        thread's last op."""
        with self.lock:
            last = self._last_host.get(self._host_lane())
            if last is not None:
                self._launches[f"host:zero_offload-{thread}"] = last

    def joined(self, thread: str) -> None:
        """This host thread waited for every task of `HostThread` ``thread`` (after its tasks ran and were
        recorded): a host wait on that thread's last op."""
        lane = f"host:zero_offload-{thread}"
        with self.lock:
            last = max((i for ln, i in self._last_host.items() if ln.startswith(lane)), default=None)
        self.host_wait(last)

    def attach(self, module: torch.nn.Module, sizes: dict[str, int] | None = None) -> list:
        """Record each parameter-owning module's forward (at its pre-hook) and backward (when the gradient of its
        output is computed, just before its own backward runs) as compute ops; returns the hook handles.
        ``sizes``: {module name: parameters}, for modules whose parameters are released (stage 3) and so have
        no elements when the hooks are attached; default: each module's own parameters now."""
        hooks = []
        for name, m in module.named_modules():
            params = sizes.get(name, 0) if sizes is not None else sum(p.numel() for p in m.parameters(recurse=False))
            if params:
                hooks.append(m.register_forward_pre_hook(self._forward_hook(name, params)))
                hooks.append(m.register_forward_hook(self._backward_hook(name, params)))
        return hooks

    def _forward_hook(self, name: str, params: int):
        def hook(_module, _args) -> None:          # returns None: the inputs stay as they are
            self.compute("forward", name, params)
        return hook

    def _backward_hook(self, name: str, params: int):
        def on_grad(_grad) -> None:
            self.compute("backward", name, params)

        def hook(_module, _args, out) -> None:
            first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,))
                          if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is not None:
                first.register_hook(on_grad)
        return hook

    # -- queries ------------------------------------------------------------------------------------------------
    def of(self, kind: str, lane: str | None = None) -> list[Op]:
        """The ops of ``kind`` (and ``lane``), in recorded order."""
        return [o for o in self.ops if o.kind == kind and (lane is None or o.lane == lane)]

    def to_list(self) -> list[dict]:
        """The ops as plain dicts (JSON), for `from_list`."""
        return [asdict(o) for o in self.ops]

    @classmethod
    def from_list(cls, ops: list[dict]) -> "Timeline":
        """A timeline holding the ops of `to_list` (a recording made in another process)."""
        tl = cls()
        tl.ops = [Op(**o) for o in ops]
        return tl


@contextlib.contextmanager
def record(module: torch.nn.Module | None = None, sizes: dict[str, int] | None = None):
    """Record into a new `Timeline` for the duration of the block (module forward/backward ops with
    ``module``, sized by ``sizes`` where given: `Timeline.attach`); yields it."""
    global _active
    if _active is not None:
        raise RuntimeError("a timeline is already being recorded")
    tl = Timeline()
    hooks = tl.attach(module, sizes) if module is not None else []
    _active = tl
    try:
        yield tl
    finally:
        _active = None
        for h in hooks:
            h.remove()


def _duration(op: Op, r: Rates) -> float:
    if op.kind == "forward":
        return 2 * op.work * r.tokens / r.gpu_flops
    if op.kind == "backward":
        return 4 * op.work * r.tokens / r.gpu_flops
    if op.kind == "host_step":
        return op.work / r.host_adam
    if op.kind in ("host_add", "host_save"):        # each a streaming copy of the state's size
        return op.work / r.host_add
    if op.lane == "h2d":
        return op.work / r.h2d
    if op.lane == "d2h":
        return op.work / r.d2h
    if op.kind == "collective":
        return op.work / r.collective if r.collective else 0.0
    return 0.0


def predict(timeline: Timeline, rates: "Rates | Callable[[Op], float]" = Rates()) -> Prediction:
    """Replay ``timeline`` with ``rates`` (or a function giving each op's seconds): each op starts when its lane's
    previous op, the ops it waits for and (for a device op) the host op it was issued after have ended. See
    `Prediction`."""
    duration = rates if callable(rates) else (lambda op: _duration(op, rates))
    times: dict[int, tuple[float, float]] = {}
    lane_end: dict[str, float] = {}
    cause: dict[int, int | None] = {}
    last_in_lane: dict[str, int] = {}
    for op in timeline.ops:                       # recorded order is a valid order: every dep was recorded first
        ready = [(lane_end.get(op.lane, 0.0), last_in_lane.get(op.lane))]
        ready += [(times[a][1], a) for a in op.after if a in times]
        if op.issued_by is not None and not op.lane.startswith("host:"):
            ready.append((times[op.issued_by][1], op.issued_by))
        start, why = max(ready, key=lambda x: x[0])
        end = start + duration(op)
        times[op.id] = (start, end)
        cause[op.id] = why
        lane_end[op.lane] = end
        last_in_lane[op.lane] = op.id
    if not times:
        return Prediction(0.0, 0.0, 0.0, {}, [])
    step = max(end for _, end in times.values())
    compute = sum(e - s for i, (s, e) in times.items() if timeline.ops[i].lane == "compute")
    path, node = [], max(times, key=lambda i: times[i][1])
    while node is not None:
        path.append(node)
        node = cause[node]
    return Prediction(step, compute, 1 - compute / step if step > 0 else 0.0, times, path[::-1], cause)
