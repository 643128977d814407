"""The measurements of benchmarks/gpu_validate.py that can be checked without a GPU (issue 20, section 6): the copy
/ compute overlap and the host-sync count from a profiler trace, the self-sizing search, and the profiler path on
the CPU."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_measure  # noqa: E402
import gpu_validate  # noqa: E402


def _ev(cat, name, ts, dur):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur}


def test_copy_overlap_intersects_copies_with_the_union_of_kernels():
    events = [_ev("kernel", "gemm", 0, 10), _ev("kernel", "gemm", 5, 10),          # kernels cover [0, 15)
              _ev("kernel", "adam", 30, 10),                                       # and [30, 40)
              _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 10, 10),         # 5 of 10 hidden
              _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 35, 10),         # 5 of 10 hidden
              _ev("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 100),         # not a host copy
              _ev("cuda_runtime", "cudaStreamSynchronize", 0, 1), _ev("cuda_runtime", "cudaDeviceSynchronize", 2, 1),
              _ev("cuda_runtime", "cudaEventSynchronize", 3, 1), _ev("cpu_op", "cudaStreamSynchronize", 4, 1)]
    share, seconds = gpu_measure.copy_compute_overlap(events)
    assert share == 0.5 and seconds == 20e-6
    figures = gpu_measure.trace_figures(events, steps=2)
    assert figures["host_syncs_per_step"] == 1.0 and figures["event_syncs_per_step"] == 0.5
    # the synchronisation that closes the profiled steps is the measurement's own, not the step's
    assert gpu_measure.trace_figures(events, steps=2, own_syncs=1)["host_syncs_per_step"] == 0.5
    assert gpu_measure.copy_compute_overlap([_ev("kernel", "k", 0, 5)]) == (None, 0.0)
    # per direction: each copy half hidden; summed sync time; kernels cover 25 us of a 100 us step
    timed = gpu_measure.trace_figures(events, steps=1, wall_s=100e-6)
    assert timed["copies"]["d2h"]["overlap"] == 0.5 and timed["copies"]["h2d"]["s"] == 10e-6
    assert timed["host_sync_s_per_step"] == 2e-6 and timed["event_sync_s_per_step"] == 1e-6
    assert abs(timed["device_idle_share"] - 0.75) < 1e-12


def test_the_profiler_path_runs_on_the_cpu():
    x = torch.randn(64, 64)
    figures = gpu_measure.profile_steps(lambda: x @ x, torch.device("cpu"), steps=2)
    assert figures["host_syncs_per_step"] == 0 and figures["copy_overlap"] is None


def test_rss_peak_is_this_runs_peak_not_the_processes(monkeypatch):
    """A run's peak is the largest resident set sampled during it; a later run starts afresh (``ru_maxrss`` would
    repeat the earlier run's peak). The resident set is scripted: the allocator may reuse resident pages."""
    import time
    assert gpu_measure.RssPeak().stop() > 1 << 20          # /proc/self/statm read, in bytes
    level = {"rss": 100}
    monkeypatch.setattr(gpu_measure.RssPeak, "_rss", lambda self: level["rss"])
    first = gpu_measure.RssPeak(interval_s=0.001)
    level["rss"] = 500
    time.sleep(0.05)
    level["rss"] = 200
    assert first.stop() == 500
    assert gpu_measure.RssPeak(interval_s=0.001).stop() == 200


def test_grow_doubles_then_bisects_within_its_budget():
    tried = []

    def fits_up_to_5(size, left):
        tried.append(size)
        return {"layers": size, "ok": size <= 5, "wall_s": 0.01 * size}

    best, tries = gpu_validate.grow(fits_up_to_5, 1, budget_s=60)
    assert tried == [1, 2, 4, 8, 6, 5] and best["layers"] == 5 and len(tries) == 6
    # A try predicted to outrun what is left of the budget is not started.
    slow = lambda size, left: {"layers": size, "ok": True, "wall_s": 30.0 * size}      # noqa: E731
    best, tries = gpu_validate.grow(slow, 2, budget_s=100)
    assert [t["layers"] for t in tries] == [2] and best["layers"] == 2
    best, tries = gpu_validate.grow(lambda s, left: {"layers": s, "ok": False, "wall_s": 0.0}, 2, budget_s=10)
    assert best is None and [t["layers"] for t in tries] == [2, 1]
