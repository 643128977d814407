"""`engine.timings` (issue 20, section 6): the keys exist, the parts add up to at most the step, the exposed host
step is part of the optimizer phase, a new step starts from zero; and the device path (CUDA events) computes its
keys from the events, checked here with events that read the host clock."""
import time

import pytest
import torch

import zero_offload
from reference import MICRO, engine_config
from toy_model import batch, make_model
from zero_offload.runtime.step_timer import DEVICE_KEYS, WALL_KEYS, StepTimer

GAS = 2


def _step(engine, step, gas=GAS):
    x, y = batch(step, MICRO * gas)
    for k in range(gas):
        rows = slice(k * MICRO, (k + 1) * MICRO)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()


HOST_KEYS = {"host_step_s", "host_step_threads"}


def _consistent(t):
    assert set(t) == set(WALL_KEYS) | HOST_KEYS          # CPU: wall-clock keys, and the host step's own
    assert all(v >= 0 for v in t.values()) and t["host_step_threads"] >= 1
    assert t["forward_s"] > 0 and t["backward_s"] > 0 and t["optimizer_s"] > 0
    assert t["forward_s"] + t["backward_s"] + t["optimizer_s"] <= t["step_s"] + 1e-6
    assert t["exposed_host_step_s"] <= t["optimizer_s"] + 1e-6


@pytest.mark.parametrize("stage,offload,dpu", [(0, "none", False), (2, "cpu", False), (2, "cpu", True)])
def test_timings_keys_and_consistency_on_cpu(stage, offload, dpu):
    zero = {"offload_optimizer": {"device": offload, "delayed_param_update": True, "dpu_warmup_steps": 1}} \
        if dpu else {}
    engine = zero_offload.initialize(make_model(), engine_config(stage, offload, GAS, **zero))
    for step in range(3):
        _step(engine, step)
        t = engine.timings
        _consistent(t)
        # On the CPU the host step is the optimizer step itself (or, delayed, the wait for its thread).
        assert t["exposed_host_step_s"] > 0 or (dpu and step >= 1)
        assert t["host_step_s"] > 0 and (dpu or t["host_step_s"] <= t["optimizer_s"])
    # A new step starts from zero: after its first forward only forward time is counted.
    x, y = batch(9, MICRO)
    loss = engine(x, y)
    t = engine.timings
    assert t["forward_s"] > 0 and t["backward_s"] == t["optimizer_s"] == t["step_s"] == 0.0
    engine.backward(loss)
    assert engine.timings["backward_s"] > 0


class _HostClockEvent:
    """A stand-in for torch.cuda.Event that reads the host clock, to check the device path's arithmetic."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        assert self.t is not None

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0


def test_device_keys_from_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _HostClockEvent)
    timer = StepTimer(torch.device("cuda"))
    for _ in range(2):                     # two micro-steps, then the optimizer with a host step inside
        with timer.phase("forward"):
            time.sleep(0.002)
        with timer.phase("backward"):
            time.sleep(0.002)
    with timer.phase("optimizer"):
        with timer.host_wait():
            time.sleep(0.003)
    timer.end_step()
    t = timer.result()
    assert set(t) == set(WALL_KEYS) | set(DEVICE_KEYS)
    assert t["device_forward_s"] >= 0.004 and t["device_backward_s"] >= 0.004
    assert t["device_exposed_host_step_s"] >= 0.003
    assert t["device_exposed_host_step_s"] <= t["device_optimizer_s"] + 1e-9
    parts = t["device_forward_s"] + t["device_backward_s"] + t["device_optimizer_s"]
    assert parts <= t["device_step_s"] + 1e-9
    assert timer.result() == t                      # read once: a second read does not add again
    with timer.phase("forward"):                    # the next step starts from zero
        pass
    assert timer.result()["device_step_s"] == 0.0 and timer.result()["backward_s"] == 0.0


def _thread_cores(name_prefix: str, before: set) -> set[int]:
    """The cores a live thread of this process started since ``before`` may run on, from /proc (Linux)."""
    import threading
    (thread,) = [t for t in threading.enumerate() if t.name.startswith(name_prefix) and t not in before]
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
    cores = set()
    for part in line.split(":")[1].strip().split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


@pytest.mark.parametrize("perc", [0.5, 1.0])
def test_cpuadam_cores_perc_sizes_the_host_step_and_pins_its_thread(perc):
    """``offload_optimizer.cpuadam_cores_perc`` (DeepSpeed's key): the kernel's thread count is that share of the
    process's cores (at least 1), and the delayed update's host-step thread runs on those cores only."""
    import os
    from zero_offload.offload.host_cores import host_step_cores
    cores = sorted(os.sched_getaffinity(0))
    zero = {"offload_optimizer": {"device": "cpu", "delayed_param_update": True, "dpu_warmup_steps": 0,
                                  "cpuadam_cores_perc": perc}}
    import threading
    before = set(threading.enumerate())
    engine = zero_offload.initialize(make_model(), engine_config(2, "cpu", 1, **zero))
    for step in range(2):
        _step(engine, step, gas=1)
    expected = host_step_cores(perc)
    assert len(expected) == max(1, int(len(cores) * perc)) and set(expected) <= set(cores)
    assert engine.timings["host_step_threads"] == len(expected)
    assert _thread_cores("zero_offload-host-step", before) == set(expected)
    engine.close()


def test_cpuadam_cores_perc_out_of_range_names_the_key():
    from zero_offload.config import ConfigError
    zero = {"offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 1.5}}
    with pytest.raises(ConfigError, match="cpuadam_cores_perc"):
        zero_offload.initialize(make_model(), engine_config(2, "cpu", 1, **zero))
