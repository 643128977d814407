"""Which host cores the host optimizer step runs on: ``offload_optimizer.cpuadam_cores_perc`` (DeepSpeed 0.19.8's
key, default 0.8) of the cores this process may use go to the host step, the rest to the training thread that
feeds the device (a kernel on every core beside the training thread, the staging thread and the delayed
update's thread would compete with them).

The split is made once, at ``initialize``, for a host step that runs beside the training thread (the delayed
update): its kernel runs with that many OpenMP threads on every step, and its persistent host-step thread is
pinned to those cores where the OS allows (``os.sched_setaffinity`` on Linux; elsewhere only the thread count
applies). Its OpenMP team, created by that thread, inherits the pinning. A synchronous host step keeps every
core (``torch.get_num_threads()``): the training thread only waits for it (on 2 cores a 0.8 share is 1 thread,
which made the synchronous step slower). The training thread is left where the user put it. DeepSpeed applies the key
to SuperOffload's CPU Adam process only; here it sizes every host step.
"""
from __future__ import annotations

import math
import os

__all__ = ["available_cores", "host_step_cores", "pin_current_thread"]


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on, in increasing order (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def host_step_cores(cores_perc: float, cores: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The cores of the host step: the last ``max(1, floor(len(cores) x cores_perc))`` of ``cores`` (default
    `available_cores`), so the training thread keeps the first ones (core 0 is where a process usually starts).

    Raises:
        ValueError: ``cores_perc`` outside [0, 1].
    """
    if not 0.0 <= cores_perc <= 1.0:
        raise ValueError(f"cpuadam_cores_perc must lie in [0, 1], got {cores_perc}")
    cores = available_cores() if cores is None else tuple(cores)
    count = max(1, math.floor(len(cores) * cores_perc))
    return cores[len(cores) - count:]


def pin_current_thread(cores: tuple[int, ...]) -> bool:
    """Restrict the calling thread to ``cores``; False where the OS has no per-thread affinity call."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return False
    os.sched_setaffinity(0, cores)          # pid 0: the calling thread on Linux
    return True
