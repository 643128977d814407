"""The tensors a CPU collective is given stay referenced from Python until the backend's worker thread lets go.

Why: gloo (and MPI) run each collective on a worker thread of the process group, which lets go of the work's
tensors just after completing it, after the caller's ``wait`` has returned. Letting go of a tensor that Python
has seen takes the GIL (since torch 2.10 a tensor that C++ refers to holds a reference to its Python object,
given back by the last C++ reference; before, the last reference frees it). During interpreter exit the worker
cannot take the GIL: it is unwound through C++ frames and the process aborts with "terminate called without an
active exception" (any script on gloo that returns without ``destroy_process_group``; torch does not guard it).

So every CPU tensor given to a collective is a fresh alias (`torch.Tensor.detach`: the same storage) held here
until nothing but this hold refers to it, from C++ (its use count) or from Python (its reference count, against
a tensor only a list refers to). `handed` drops the aliases the backend has let go of, without waiting, each
time it is called; `settle` waits for the rest, bounded: at `zero_offload.comm.DistContext.close` and at
interpreter exit (an `atexit` hook: it runs after the engine's host threads have ended and before the
interpreter finalizes). CUDA tensors are given as they are (NCCL's works end on its own threads; not seen to
abort, and not measured here).

A script's own collectives are safe once it calls ``destroy_process_group``: that joins the group's workers,
which then let go with the interpreter alive. Unless something else still holds the group: the functions of
``torch.distributed.nn.functional`` default to ``group=group.WORLD``, bound when that module is first imported,
and torch imports it with ``torch._dynamo``, which the first torch optimizer imports -- the engine's, built after
``init_process_group``. The default group then outlived ``destroy_process_group`` and its workers ran into
interpreter exit; a worker that let go of the script's own all-reduced tensor there aborted a two-rank script now
and then (BENCHMARKS.md, "Clean exits"). So that module is imported here, with ``zero_offload``: before the script
creates its group, its defaults are None. (A script that imports ``zero_offload`` after creating its group, or
imports that module itself then, still leaves the group held.)
"""
from __future__ import annotations

import atexit
import sys
import threading
import time

import torch
import torch.distributed as dist

if dist.is_available():
    import torch.distributed.nn.functional  # noqa: F401  (first imported before any group: see above)

__all__ = ["handed", "settle", "pending", "SETTLE_S"]

SETTLE_S = 10.0          # how long `settle` waits at most, in seconds; a backend lets go in microseconds
_POLL_S = 0.001
_lock = threading.Lock()          # simulated streams launch collectives from a host thread too
_held: list[torch.Tensor] = []
_hooked = False


def handed(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors to give a collective in place of ``tensors``: each CPU tensor as a new alias of it (same
    storage, shape, strides and dtype; writes by the collective land in ``tensors``) held until the backend lets
    go of it; a CUDA tensor as it is. Drops, without waiting, the aliases of earlier collectives that the
    backend has let go of."""
    out = [t.detach() if t.device.type == "cpu" else t for t in tensors]
    fresh = [a for a, t in zip(out, tensors) if a is not t]
    if not fresh:
        return out
    global _hooked
    with _lock:
        _held[:] = _still_referred(_held)
        _held.extend(fresh)
        if not _hooked:
            _hooked = True
            atexit.register(settle)
    return out


def pending() -> int:
    """How many aliases handed to collectives the backend still holds (or an unwaited work handle refers to)."""
    with _lock:
        _held[:] = _still_referred(_held)
        return len(_held)


def _still_referred(held: list[torch.Tensor]) -> list[torch.Tensor]:
    """The aliases of ``held`` that something besides the hold still refers to."""
    probe = held + [torch.empty(0)]        # the last one: referred to by ``probe`` only
    counts = [sys.getrefcount(a) for a in probe]
    return [a for a, n in zip(held, counts) if a._use_count() > 1 or n > counts[-1] + 1]


def settle(timeout_s: float = SETTLE_S) -> bool:
    """Wait until the backend has let go of every tensor `handed` gave out, for up to ``timeout_s`` seconds;
    True when it has. An alias still held at the deadline (a collective that never completes: a stalled peer)
    stays held, so that a worker never frees it."""
    end = time.monotonic() + timeout_s
    while pending():
        if time.monotonic() >= end:
            return False
        time.sleep(_POLL_S)
    return True
