"""`zero_offload.runtime.host_thread.HostThread`, the one kind of thread the engine starts (issue 26): tasks run in order
on one persistent worker, a failure is re-raised once at `join` while later tasks still run, `close` runs what is
queued and joins the worker, a closed thread refuses work by name, and a forked child gets a worker of its own."""
import os
import threading
import time

import pytest
import torch

from zero_offload.runtime.host_thread import HostThread, HostThreadClosed, HostThreadError


def workers(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"zero_offload-{name}")]


def test_tasks_run_in_order_on_one_persistent_worker_and_a_failure_is_re_raised_once():
    thread = HostThread("order", torch.device("cpu"))
    seen, idents = [], set()
    for i in range(5):
        thread.submit(lambda i=i: (time.sleep(0.001), seen.append(i), idents.add(threading.get_ident())))
    thread.join()
    assert seen == list(range(5)) and not thread.busy and thread.queued == 0
    time.sleep(0.1)                              # idle: the worker stays (no thread per step)
    thread.submit(lambda: idents.add(threading.get_ident()))
    thread.join()
    assert len(idents) == 1 and len(workers("order")) == 1

    def fail():
        raise ValueError("boom")
    thread.submit(fail)
    thread.submit(lambda: seen.append("after"))  # later tasks still run (they free their slots)
    with pytest.raises(HostThreadError, match="'order'") as info:
        thread.join()
    assert isinstance(info.value.__cause__, ValueError) and seen[-1] == "after"
    thread.join()                                # raised once
    thread.close()


def test_close_runs_what_is_queued_joins_the_worker_and_refuses_more():
    thread = HostThread("closing")
    seen = []
    for i in range(3):
        thread.submit(lambda i=i: (time.sleep(0.02), seen.append(i)))
    thread.close()
    assert seen == [0, 1, 2] and workers("closing") == [] and not thread.alive
    with pytest.raises(HostThreadClosed, match="'closing' was closed"):
        thread.submit(lambda: None)
    thread.close()                               # idempotent


def test_close_raises_a_failure_not_yet_joined():
    thread = HostThread("closing-failed")
    thread.submit(lambda: 1 / 0)
    with pytest.raises(HostThreadError) as info:
        thread.close()
    assert isinstance(info.value.__cause__, ZeroDivisionError) and workers("closing-failed") == []


def test_a_forked_child_runs_work_on_a_worker_of_its_own():
    thread = HostThread("forked")
    thread.submit(lambda: None)
    thread.join()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                 # the parent's worker is not in the child
        ok = False
        try:
            box = []
            thread.submit(lambda: box.append(threading.get_ident()))
            thread.join()
            ok = box != [] and box[0] != threading.get_ident()
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1"
    thread.close()
