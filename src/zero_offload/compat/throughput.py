"""DeepSpeed's ``ThroughputTimer``: the engine face's ``tput_timer``, started in forward and stopped in step."""
from __future__ import annotations

import time

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    """DeepSpeed's samples-per-second timer: `start` before a micro-step's forward, `stop` after its step; steps
    from ``start_step`` on are timed (wall clock, no device synchronisation: the engine's step waits for its own
    work). ``update_epoch_count``, ``avg_samples_per_sec`` and the counters are DeepSpeed's."""

    def __init__(self, config=None, batch_size=None, start_step: int = 2, steps_per_output=None,
                 monitor_memory: bool = False, logging_fn=None):
        self.config = config
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step, self.steps_per_output = start_step, steps_per_output
        self.start_time = self.end_time = 0.0
        self.started = self.initialized = False
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Training samples per second over the timed steps (-inf before any step)."""
        if self.global_step_count > 0:
            timed = self.global_step_count - self.start_step
            return self.batch_size / (self.total_elapsed_time / timed) if timed > 0 and self.total_elapsed_time \
                else float("-inf")
        return float("-inf")
