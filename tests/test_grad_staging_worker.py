"""`offload.grad_staging.StagingWorker`: the host thread that adds staged gradient pieces runs its tasks in
order, re-raises a task's failure in the caller at `join` (chained), and leaves no thread behind when idle."""
import threading
import time

import pytest
import torch

from zero_offload.offload.grad_staging import IDLE_EXIT_S, StagingWorker


def test_tasks_run_in_order_and_a_failure_is_re_raised_at_join():
    worker = StagingWorker("test", torch.device("cpu"))
    seen = []
    for i in range(5):
        worker.submit(lambda i=i: (time.sleep(0.001), seen.append(i)))
    worker.join()
    assert seen == list(range(5)) and not worker.busy

    def fail():
        raise ValueError("boom")
    worker.submit(fail)
    worker.submit(lambda: seen.append("after"))      # later tasks still run (they free their slots)
    with pytest.raises(RuntimeError, match="staging worker") as info:
        worker.join()
    assert isinstance(info.value.__cause__, ValueError) and seen[-1] == "after"
    worker.join()                                    # the failure is raised once


def test_an_idle_worker_leaves_no_thread():
    worker = StagingWorker("idle", torch.device("cpu"))
    worker.submit(lambda: None)
    worker.join()
    deadline = time.monotonic() + 20 * IDLE_EXIT_S
    while any(t.name == "zero_offload-idle" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(IDLE_EXIT_S / 5)
    assert not any(t.name == "zero_offload-idle" for t in threading.enumerate())
    worker.submit(lambda: None)                      # and starts a new one on demand
    worker.join()
