"""The pinned host staging an offloaded gradient partition holds under gradient accumulation, and the host thread
that empties it.

Under gradient accumulation an offloaded stage-2/3 partition is fp32 on the host, and a reduced gradient piece (a
stage-2 bucket's share of this rank's partition, or a stage-3 unit's reduce-scattered shard) arrives in the
communication/training dtype on the device. From the second micro-step on the piece is added to what earlier
micro-steps left there; on the first it is converted into the partition. Either way it is copied down as it is
(16-bit bytes over PCIe, no conversion on the copy stream) into a pinned staging slot, and a host thread
(`StagingWorker`) waits for that copy's event and adds (or converts) it into the partition
(`zero.grad_partition.GradPartition`). The backward hook only issues the copy.

The pool is double-buffered: `STAGING_SLOTS` = 2 slots, each the largest piece the partition can receive, so a
piece goes down whole while the worker adds the previous one; the hook waits only when the piece two behind has
not been added yet. It is allocated once per partition and never grows with the number of micro-steps.
DeepSpeed's offloaded stage 2 copies each reduced bucket into fixed pinned buffers and accumulates on the CPU
(``async_accumulate_grad_in_cpu_via_gpu``); FSDP2's CPU offload copies each reduce-scattered shard down whole.

This module is the one place that sizes that pool: the engine allocates it with `staging_shape`, and the memory
model (`zero_offload.estimate`) counts it with the same function, as the line ``grad_staging``.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from typing import Callable

import torch

__all__ = ["STAGING_SLOTS", "STAGING_FORMULA", "IDLE_EXIT_S", "staging_shape", "uses_grad_staging", "StagingWorker"]

STAGING_SLOTS = 2
STAGING_FORMULA = ("gas > 1: 2 pinned slots x the largest piece per offloaded partition (stage 2: min(bucket, P); "
                   "stage 3: the largest unit shard) x the reduced dtype's bytes")
IDLE_EXIT_S = 0.05      # a worker with nothing queued for this long ends (no thread outlives its work)


def uses_grad_staging(stage: int, offloaded: bool, gradient_accumulation: int) -> bool:
    """Whether a gradient partition holds the staging pool from the start: host partitions (optimizer or stage-3
    parameters offloaded) at stage >= 2 that accumulate over more than one micro-step (stages 0 and 1 overwrite
    at the boundary; with one micro-step per step a piece is copied straight into a partition of its own dtype).
    A partition without it allocates the same pool at a second backward before a step."""
    return offloaded and stage >= 2 and gradient_accumulation > 1


def staging_shape(piece_numel: int, element_bytes: int, slots: int = STAGING_SLOTS) -> tuple[int, int]:
    """(slot count, bytes per slot) of the pinned staging of an offloaded partition whose largest reduced piece is
    ``piece_numel`` elements of ``element_bytes`` bytes (the reduced dtype: the communication dtype, else the
    training dtype): ``slots`` slots of one whole piece each, rounded up to 64 bytes.

    Raises:
        ValueError: ``slots`` < 1, ``piece_numel`` < 0 or ``element_bytes`` < 1.
    """
    if slots < 1 or piece_numel < 0 or element_bytes < 1:
        raise ValueError(f"grad staging needs slots >= 1, piece_numel >= 0 and element_bytes >= 1, got {slots}, "
                         f"{piece_numel} and {element_bytes}")
    return slots, -(-max(piece_numel, 1) * element_bytes // 64) * 64


class StagingWorker:
    """One host thread that runs a partition's queued host-side work in submission order (wait for a staged
    copy, add it into the partition): the backward hook only queues.

    The thread starts on demand and ends after `IDLE_EXIT_S` with nothing queued, so between steps none is alive.
    It is not a daemon: a process that ends mid-backward lets it finish the adds it holds and end, rather than
    being cut inside a torch op at interpreter shutdown (the delayed update's thread is joined for the same
    reason). On CUDA
    it first binds ``device`` (the current device is per host thread). An exception in a task is kept and later
    tasks still run (each frees its own slot), so the training thread never waits on a slot for ever; `join`
    re-raises it.
    """

    def __init__(self, name: str, device: torch.device):
        self.name, self.device = name, device
        self.tasks: deque[Callable[[], None]] = deque()
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.pid = os.getpid()               # a forked child starts its own thread
        self.queued = 0                      # tasks submitted and not yet finished
        self.error: BaseException | None = None

    @property
    def busy(self) -> bool:
        """True while submitted work has not finished."""
        return self.queued > 0

    def submit(self, task: Callable[[], None]) -> None:
        """Queue ``task`` to run on the worker after everything queued before it."""
        with self.cond:
            self.tasks.append(task)
            self.queued += 1
            if self.thread is None or self.pid != os.getpid():
                self.pid = os.getpid()
                self.thread = threading.Thread(target=self._run, name=f"zero_offload-{self.name}", daemon=False)
                self.thread.start()
            self.cond.notify_all()

    def join(self) -> None:
        """Block until every task submitted so far has run.

        Raises:
            RuntimeError: a task failed (chained to the first such exception; cleared once raised).
        """
        with self.cond:
            while self.queued:
                self.cond.wait()
            error, self.error = self.error, None
        if error is not None:
            raise RuntimeError(f"the gradient staging worker ({self.name}) failed") from error

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self.cond:
                if not self.tasks and not self.cond.wait_for(lambda: bool(self.tasks), IDLE_EXIT_S):
                    self.thread = None       # submit starts a new one
                    return
                task = self.tasks.popleft()
            try:
                with torch.no_grad():
                    task()
            except BaseException as e:       # re-raised in the training thread by join
                if self.error is None:
                    self.error = e
            finally:
                with self.cond:
                    self.queued -= 1
                    self.cond.notify_all()
