"""Where an optimizer step's time goes: `Engine.timings`.

Each phase (forward, backward, the optimizer step) is bracketed twice: by the host's wall clock, and on CUDA by a
pair of CUDA events recorded on the current stream, whose elapsed time is the device's time between the phase's
first and last piece of work (idle gaps included). The host step of an offloaded optimizer, and the wait for the
delayed update's background step, are bracketed the same way: on CUDA the events' elapsed time is how long the
device waited for them (nothing is queued behind the first event until the host step returns), on the CPU it is
the training thread's wall-clock time in them.

Events are read lazily: reading `StepTimer.result` after a step waits for that step's last event (one host sync,
only when someone reads the timings). DeepSpeed's counterpart is ``wall_clock_breakdown`` (its ``SynchronizedWall
ClockTimer`` synchronises the device at every phase boundary instead).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["StepTimer", "WALL_KEYS", "DEVICE_KEYS"]

WALL_KEYS = ("forward_s", "backward_s", "optimizer_s", "step_s", "exposed_host_step_s")
DEVICE_KEYS = ("device_forward_s", "device_backward_s", "device_optimizer_s", "device_step_s",
               "device_exposed_host_step_s")


class StepTimer:
    """Times the phases of one optimizer step at a time (see the module docstring).

    Args:
        device: the compute device; CUDA events are recorded only on a CUDA device.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.wall = dict.fromkeys(WALL_KEYS, 0.0)
        self.device = dict.fromkeys(DEVICE_KEYS, 0.0) if self.cuda else {}
        self.pairs: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.start_wall: float | None = None
        self.start_event: torch.cuda.Event | None = None
        self.ended = False          # the step finished: the next phase starts a new one
        self.unresolved = False     # events of the finished step not yet read

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _begin(self) -> None:
        if self.ended or self.start_wall is None:
            self.wall = dict.fromkeys(WALL_KEYS, 0.0)
            if self.cuda:
                self.device = dict.fromkeys(DEVICE_KEYS, 0.0)
                self.start_event = self._event()
            self.pairs, self.start_wall, self.ended, self.unresolved = [], time.perf_counter(), False, False

    def phase(self, name: str):
        """Bracket phase ``name`` (``forward``, ``backward``, ``optimizer``); the first of a step starts it."""
        self._begin()
        return self._bracket(f"{name}_s", f"device_{name}_s")

    def host_wait(self):
        """Bracket a host step or a wait for the delayed update's thread, inside the ``optimizer`` phase."""
        return self._bracket("exposed_host_step_s", "device_exposed_host_step_s")

    @contextmanager
    def _bracket(self, wall_key: str, device_key: str) -> Iterator[None]:
        start = time.perf_counter()
        first = self._event() if self.cuda else None
        try:
            yield
        finally:
            self.wall[wall_key] += time.perf_counter() - start
            if self.cuda:
                self.pairs.append((device_key, first, self._event()))

    def end_step(self) -> None:
        """The optimizer step is over: fix its wall-clock span (and its last event on CUDA)."""
        if self.start_wall is None:
            return
        self.wall["step_s"] = time.perf_counter() - self.start_wall
        if self.cuda:
            self.pairs.append(("device_step_s", self.start_event, self._event()))
            self.unresolved = True
        self.ended = True

    def result(self) -> dict[str, float]:
        """{key: seconds} of the step in progress or, once it ended, of that step (see `Engine.timings`)."""
        if self.unresolved:
            self.pairs[-1][2].synchronize()       # the step's last event: every earlier one has fired too
            for key, first, last in self.pairs:
                self.device[key] += first.elapsed_time(last) / 1000.0
            self.unresolved = False
        return {**self.wall, **self.device}
