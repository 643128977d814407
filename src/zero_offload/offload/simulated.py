"""Simulated streams: asynchronous copies and collectives that really finish later, so stream ordering is
checked on a machine with no accelerator.

On the CPU every copy and every collective of one rank is synchronous (`HostCopies`, `comm.DoneWork`), so a
read that forgot to wait for its copy's event still sees the right bytes, and a test on the CPU cannot tell.
With ``ZERO_OFFLOAD_SIMULATE_STREAMS=1`` (read when an engine is built) every asynchronous transfer runs on a
worker thread instead, after a random delay of up to `MAX_DELAY_S`:

- copies down and up (`SimulatedCopies`, picked by `zero_offload.offload.copies.make_copies` on the CPU): the
  copy reads its source at that later time, as a copy stream would, so rewriting a source or reading a
  destination before the handle's wait changes the result;
- asynchronous collectives (`SimulatedCollectives`, used by `zero_offload.comm.DistContext`): the collective
  runs into a scratch buffer and its result lands in the output only later; at one rank the identity "collective"
  is a delayed copy into the output;
- NVMe reads and writes (`zero_offload.nvme.swapper.Swapper` sleeps `random_delay` before each piece).

Like a CUDA stream, each `SimulatedStream` runs its work in submission order (a later copy never lands before
an earlier one on the same stream). A `SimulatedEvent` really blocks until its work has run. The host stands
in for the compute stream, so making "the compute stream" wait for an event blocks the host.

``ZERO_OFFLOAD_SIMULATE_STREAMS_SKIP_WAITS=1`` is fault injection on top: every wait on an event (and every
whole-stream wait, and every NVMe request's wait) returns at once, and a collective's result never lands (see
`SimulatedCollectives`). Runs must then differ from runs that wait: that is the proof that the simulation sees
a missing wait. ``query`` stays truthful.

Counts of simulated work are kept per process (`counts`), for the benchmarks.
"""
from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from zero_offload.runtime.host_thread import HostThread
from zero_offload.offload import timeline
from zero_offload.offload.handles import CopyHandle, TransferCounts

__all__ = ["ENV", "SKIP_WAITS_ENV", "MAX_DELAY_S", "enabled", "waits_skipped", "forced", "random_delay",
           "SimulationCounts",
           "counts", "SimulatedEvent", "SimulatedStream", "SimulatedHandle", "SimulatedCopies", "SimulatedWork",
           "SimulatedCollectives"]

ENV = "ZERO_OFFLOAD_SIMULATE_STREAMS"
SKIP_WAITS_ENV = "ZERO_OFFLOAD_SIMULATE_STREAMS_SKIP_WAITS"
MAX_DELAY_S = 0.003          # a few milliseconds: longer than any gap the host code leaves between two steps


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


# Inside `forced`: the delay every piece of work waits (None: outside, the environment decides).
_forced_delay: float | None = None


def enabled() -> bool:
    """True when ``ZERO_OFFLOAD_SIMULATE_STREAMS`` is set (to anything but 0/false/no/off), or inside `forced`."""
    return _forced_delay is not None or _flag(ENV)


def waits_skipped() -> bool:
    """True when ``ZERO_OFFLOAD_SIMULATE_STREAMS_SKIP_WAITS`` is set as well (fault injection); never inside
    `forced`."""
    return _forced_delay is None and enabled() and _flag(SKIP_WAITS_ENV)


@contextlib.contextmanager
def forced(delay_s: float = 1e-4):
    """Simulated streams for the engines built inside the block, whatever the environment says, with waits kept
    and every piece of work delayed ``delay_s`` seconds (the step model records a step this way:
    `zero_offload.estimate.step_graph`). Not reentrant across threads: one recording at a time.

    Raises:
        RuntimeError: already inside `forced`.
    """
    global _forced_delay
    if _forced_delay is not None:
        raise RuntimeError("simulated.forced is already active")
    _forced_delay = delay_s
    try:
        yield
    finally:
        _forced_delay = None


_rng = random.Random()
_rng_lock = threading.Lock()


def random_delay() -> float:
    """A delay in seconds, uniform in [0, `MAX_DELAY_S`) (inside `forced`, its fixed delay)."""
    if _forced_delay is not None:
        return _forced_delay
    with _rng_lock:
        return _rng.uniform(0.0, MAX_DELAY_S)


@dataclass
class SimulationCounts:
    """Work delayed by the simulation in this process: copies, collectives and NVMe request pieces."""
    copies: int = 0
    collectives: int = 0
    io: int = 0


_counts = SimulationCounts()
_counts_lock = threading.Lock()


def counts() -> SimulationCounts:
    """The running totals of simulated work in this process (a copy of them)."""
    with _counts_lock:
        return SimulationCounts(_counts.copies, _counts.collectives, _counts.io)


def count(kind: str) -> None:
    """Add one to the running total of ``kind`` (``copies``, ``collectives`` or ``io``)."""
    with _counts_lock:
        setattr(_counts, kind, getattr(_counts, kind) + 1)


class SimulatedEvent:
    """The end of one piece of simulated work: set by the worker once the work has run.

    Args:
        skip: waits return at once (``ZERO_OFFLOAD_SIMULATE_STREAMS_SKIP_WAITS``).
    """

    __slots__ = ("done", "error", "skip", "op")

    def __init__(self, skip: bool, op: int | None = None):
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.skip = skip
        self.op = op              # its node in the timeline being recorded (`zero_offload.offload.timeline`)

    def query(self) -> bool:
        """True once the work has run (never blocks, never skipped)."""
        return self.done.is_set()

    def synchronize(self, host: bool = True) -> None:
        """Block until the work has run (at once under skipped waits); ``host``: a wait of the host (recorded
        as such in a timeline), not of the compute stream the host stands in for.

        Raises:
            RuntimeError: the work failed on its worker (chained to its exception).
        """
        tl = timeline.current()
        if tl is not None and host:
            tl.host_wait(self.op)
        if self.skip:
            return
        self.done.wait()
        if self.error is not None:
            raise RuntimeError("simulated asynchronous work failed on its worker thread") from self.error


class SimulatedStream:
    """A queue of work run in submission order on one `HostThread`, each item no earlier than its due time
    (submission time + `random_delay`): a CUDA stream's ordering, with the device's latency made visible.
    Its owner closes it (`close`), which runs what is queued."""

    def __init__(self, name: str, skip: bool | None = None):
        self.name = name
        self.skip = waits_skipped() if skip is None else skip
        self.thread = HostThread(f"sim-{name}")
        self.last: SimulatedEvent | None = None

    def submit(self, work: Callable[[], None], kind: str = "copies", nbytes: int = 0,
               after: CopyHandle | None = None) -> SimulatedEvent:
        """Queue ``work`` (moving ``nbytes``) to run after a random delay; returns the event set once it has run.
        ``after``: the compute point it waits for in a recorded timeline (default: the compute queued so far)."""
        tl = timeline.current()
        waits = None if after is None else [after.event.op if after.event is not None else None]
        op = tl.queued(self.name, "copy" if kind == "copies" else "collective", nbytes, waits) if tl else None
        event = SimulatedEvent(self.skip, op)
        count(kind)
        due = time.monotonic() + random_delay()

        def run() -> None:
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                work()
            except BaseException as e:      # re-raised by whoever waits on the event
                event.error = e
            finally:
                event.done.set()
        self.thread.submit(run)
        self.last = event
        return event

    def synchronize(self) -> None:
        """Block until everything submitted so far has run (at once under skipped waits)."""
        last = self.last
        if last is not None:
            last.synchronize()

    def close(self) -> None:
        """Run what is queued and end the stream's thread (from its owner's ``close``)."""
        self.thread.close()


def delayed_copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    """The work of one copy: ``dst.copy_(src)`` when it runs. A destination whose storage was freed meanwhile
    (a stage-3 buffer released while its gather was, under skipped waits, still in flight) is left alone, as
    a device would scribble into memory that is no longer anyone's."""
    def work() -> None:
        need = (dst.storage_offset() + dst.numel()) * dst.element_size()
        if dst.untyped_storage().nbytes() >= need:
            dst.copy_(src)
    return work


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _nothing() -> None:
    """The work of a collective with nothing to move (one rank's in-place reduce)."""


class SimulatedHandle(CopyHandle):
    """A `CopyHandle` on a `SimulatedEvent`: the host is the compute stream, so `wait_stream` blocks it."""

    __slots__ = ()

    def wait_stream(self, stream=None) -> None:
        """Block the host until the copy has run (the host computes; at once under skipped waits)."""
        if self.event is not None:
            tl = timeline.current()
            if tl is not None:
                tl.compute_waits_for(self.event.op)
            self.event.synchronize(host=False)


class SimulatedCopies:
    """The `Copies` of a CPU run under simulation: `HostCopies`' buffers, each copy run later on a side
    stream (one per direction, as `CudaCopies`), its handle waiting for real."""

    cuda = False
    synchronous = False

    def __init__(self, device: torch.device, pin: bool = False):
        self.device, self.pin = device, False
        self.counts = TransferCounts()
        self.d2h, self.h2d = SimulatedStream("d2h"), SimulatedStream("h2d")

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        """Copy ``src`` into ``dst`` later on the device-to-host stream; ``src`` is read then."""
        self.counts.bytes_down += dst.numel() * dst.element_size()
        return SimulatedHandle(self.d2h.submit(delayed_copy(dst, src), nbytes=_nbytes(dst)), self.counts)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: CopyHandle | None = None) -> CopyHandle:
        """Copy ``src`` into ``dst`` later on the host-to-device stream; ``src`` is read then. ``after`` (a
        `compute_point`) is behind the host already: the host is the compute."""
        self.counts.bytes_up += dst.numel() * dst.element_size()
        return SimulatedHandle(self.h2d.submit(delayed_copy(dst, src), nbytes=_nbytes(dst), after=after), self.counts)

    def compute_point(self) -> CopyHandle:
        """See `CudaCopies.compute_point`: the host is the compute, already past the point (a done event, naming
        the last compute op in a recorded timeline)."""
        tl = timeline.current()
        event = SimulatedEvent(skip=True, op=tl.compute_point() if tl is not None else None)
        event.done.set()
        return SimulatedHandle(event, self.counts)

    def upload(self, src: torch.Tensor) -> tuple[torch.Tensor, CopyHandle]:
        """A new "device" copy of ``src``, filled later on the host-to-device stream (as `CudaCopies.upload`)."""
        dst = torch.empty_like(src, device=self.device)
        return dst, self.to_device(dst, src)

    def uploads_read(self, event) -> None:
        """Nothing to order: a simulated upload's buffer is a host tensor, kept alive by whoever reads it."""

    def downloads_after(self, handle: CopyHandle) -> None:
        """The device-to-host stream waits for ``handle``'s copy (its worker blocks on the event), as
        `CudaCopies.downloads_after`; the host goes on. Under skipped waits it does not wait."""
        event = handle.event
        if event is not None:
            tl = timeline.current()
            if tl is not None:
                tl.stream_waits_for("d2h", event.op)
            self.d2h.submit(lambda: event.synchronize(host=False))

    def synchronize(self) -> None:
        """Block until every copy queued so far has run (whole-stream waits, as `CudaCopies.synchronize`)."""
        self.d2h.synchronize()
        self.h2d.synchronize()

    def wait_for_copies(self) -> None:
        """The compute (the host) after every copy queued so far: the same as `synchronize` here."""
        self.synchronize()

    def close(self) -> None:
        """Run every copy queued and end both streams' threads."""
        self.d2h.close()
        self.h2d.close()


class SimulatedWork:
    """The handle of a simulated collective (torch's ``Work`` face: ``wait``, ``is_completed``)."""

    def __init__(self, event: SimulatedEvent):
        self.event = event

    def wait(self) -> bool:
        """Block until the result is in the output (at once under skipped waits). As NCCL's ``wait``, a wait of
        the compute stream (the host stands in for it)."""
        tl = timeline.current()
        if tl is not None:
            tl.compute_waits_for(self.event.op)
        self.event.synchronize(host=False)
        return True

    def is_completed(self) -> bool:
        return self.event.query()


class SimulatedCollectives:
    """Asynchronous collectives whose results land later, on one simulated communication stream.

    The real collective (gloo, or nothing at one rank) is launched at once into a scratch buffer; a work
    item on the stream waits for it and, after its delay, copies the result into the caller's output. So
    reading the output before ``wait`` sees the bytes that were there before, as with NCCL.

    Under skipped waits a result never lands: a stage-3 gather's buffer may be freed (its storage resized to
    zero) while the gather is in flight, and a late write could then race the free. Reads still see stale
    bytes, which is what the fault injection is for.
    """

    def __init__(self):
        self.stream = SimulatedStream("comm")
        self.lands = not self.stream.skip

    def into(self, out: torch.Tensor, launch: Callable[[torch.Tensor], object] | None,
             inp: torch.Tensor | None = None) -> SimulatedWork:
        """Run ``launch(scratch)`` (the collective writing into ``scratch``, shaped as ``out``; returns its async
        work handle) now, and land ``scratch`` in ``out`` later. Without ``launch`` (one rank), ``out`` gets
        ``inp`` later, read then."""
        if launch is None:
            return SimulatedWork(self.stream.submit(delayed_copy(out, inp) if self.lands else _nothing,
                                                    "collectives", _nbytes(out)))
        scratch = torch.empty_like(out)
        handle = launch(scratch)
        land = delayed_copy(out, scratch)

        def work() -> None:
            handle.wait()
            if self.lands:
                land()
        return SimulatedWork(self.stream.submit(work, "collectives", _nbytes(out)))

    def close(self) -> None:
        """Land what is queued and end the communication stream's thread (from `DistContext.close`)."""
        self.stream.close()

    def in_place(self, tensor: torch.Tensor, launch: Callable[[torch.Tensor], object] | None,
                 receives: bool = True) -> SimulatedWork:
        """An in-place collective (reduce, all-reduce) on a copy of ``tensor`` taken now; the result lands in
        ``tensor`` later where this rank ``receives`` it. Without ``launch`` (one rank) the identity, complete
        at once, as on a GPU (`comm.DoneWork`): nothing moves, and a reduction finished at launch lets its copy
        down start at once (`zero_offload.zero.collectives.InFlight`)."""
        if launch is None:
            count("collectives")
            done = SimulatedEvent(self.stream.skip)
            done.done.set()
            return SimulatedWork(done)
        scratch = tensor.clone()
        handle = launch(scratch)

        def work() -> None:
            handle.wait()
            if receives and self.lands:
                tensor.copy_(scratch)
        return SimulatedWork(self.stream.submit(work, "collectives", _nbytes(tensor)))
