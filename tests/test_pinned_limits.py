"""Pinned memory that cannot be had (issue 42, item 3): where page-locking fails, host buffers stay pageable with one
warning that names the bytes, the locked-memory limit and how to raise it, and training goes on; the limits are read
(``RLIMIT_MEMLOCK`` where it binds, the cgroup's memory limit) and the planner plans within them. On the CPU the
failure is simulated at the allocator seam (`zero_offload.offload.pinned.host_empty`'s ``cudaHostRegister``); on CUDA
`tests/test_cuda.py` trains through it.
"""
from __future__ import annotations

import resource
import warnings

import pytest
import torch

import zero_offload
from zero_offload.offload import host_limits, pinned


class RefusingCudart:
    """``cudaHostRegister`` failing as a capped container's does (cudaErrorMemoryAllocation)."""
    calls = 0

    def cudaHostRegister(self, ptr, nbytes, flags):
        RefusingCudart.calls += 1
        return 2


@pytest.fixture
def refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "_cudart", RefusingCudart)
    monkeypatch.setattr(pinned, "_warned", False)
    monkeypatch.setattr(pinned, "_fallback_bytes", 0)
    RefusingCudart.calls = 0


def test_a_refused_page_lock_stays_pageable_with_one_warning(refused):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a = pinned.host_empty(1000, torch.float32, pin=True)
        b = pinned.host_empty(500, torch.bfloat16, pin=True)
    assert RefusingCudart.calls == 2                              # both were tried
    assert (a.numel(), a.dtype, b.numel(), b.dtype) == (1000, torch.float32, 500, torch.bfloat16)
    assert not pinned.is_page_locked(a) and pinned.pinned_bytes() == 0
    assert pinned.pageable_fallback_bytes() == 4000 + 1000
    messages = [str(w.message) for w in seen if issubclass(w.category, pinned.PinnedMemoryWarning)]
    assert len(messages) == 1, messages
    assert "page-locking 4000 bytes" in messages[0] and "RLIMIT_MEMLOCK" in messages[0]
    assert "ulimit -l unlimited" in messages[0] and "pin_memory" in messages[0]
    a.fill_(1.0)                                                  # ordinary host memory, usable as such
    assert a.sum().item() == 1000


def test_the_limits_are_read(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("max\n")
    assert host_limits.cgroup_memory_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text("1073741824\n")
    assert host_limits.cgroup_memory_limit(tmp_path) == 1 << 30
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")     # v1: no limit
    assert host_limits.cgroup_memory_limit(tmp_path) is None
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("2147483648\n")
    assert host_limits.cgroup_memory_limit(tmp_path) == 2 << 30
    assert host_limits.cgroup_memory_limit(tmp_path / "absent") is None
    monkeypatch.setattr(resource, "getrlimit", lambda _: (8 << 20, 8 << 20))
    monkeypatch.setattr(host_limits.os, "geteuid", lambda: 1000)
    assert host_limits.memlock_limit() == 8 << 20
    monkeypatch.setattr(host_limits.os, "geteuid", lambda: 0)          # CAP_IPC_LOCK lifts it
    assert host_limits.memlock_limit() is None
    monkeypatch.setattr(host_limits.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert host_limits.memlock_limit() is None


def test_this_machine_plans_within_the_cgroup_limit(monkeypatch):
    from zero_offload.estimate.table import this_machine
    monkeypatch.setattr(host_limits, "cgroup_memory_limit", lambda root=None: 3 << 30)
    assert host_limits.usable_host_memory() == 3 << 30 == this_machine()["host_memory"]


def _plan(**kw):
    return zero_offload.plan("gpt2-xl", gpus=1, gpu_memory="24GB", host_memory="64GB", micro_batch=8,
                             gradient_accumulation=1, **kw)


def test_past_the_locked_memory_limit_the_plan_predicts_pageable_copies():
    free = _plan()
    pinned_bytes = free.batch.estimate.pinned
    assert pinned_bytes > 0 and "pin_memory" not in free.reasons
    assert "pin_memory" not in _plan(locked_memory=2 * pinned_bytes).reasons
    capped = _plan(locked_memory=8 << 20)
    assert "8.0 MiB (RLIMIT_MEMLOCK)" in capped.reasons["pin_memory"]
    assert "ulimit -l unlimited" in capped.reasons["pin_memory"]
    assert capped.batch.timing.tokens_per_s < free.batch.timing.tokens_per_s


def test_the_estimate_counts_the_page_locked_buffers():
    """What the engine page-locks with pin_memory: the gradient partition (16-bit) and, under accumulation, its
    staging; not the masters or moments of bf16 training (only the host kernel reads them)."""
    from zero_offload.estimate import estimate_memory
    from zero_offload.estimate.memory import default_plan_config
    cfg = default_plan_config()
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    est = estimate_memory("gpt2", cfg, 1, accelerator=True)
    assert est.pinned == est.host["grad_partition"]
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    assert estimate_memory("gpt2", cfg, 1, accelerator=True).pinned == 0
