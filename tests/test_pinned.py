"""Page-locked host memory is released without a device call from a garbage-collector finalizer (issue 20,
section 3): `zero_offload.offload.pinned` on a fake CUDA runtime that records every call."""
from __future__ import annotations

import gc

import pytest
import torch

from zero_offload.offload import pinned


class FakeCudart:
    def __init__(self, calls: list):
        self.calls = calls

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def calls(monkeypatch):
    """Every CUDA call `pinned` makes, in order (``synchronize`` included), on a machine that pretends to have
    CUDA; the process's real pinned state is left alone."""
    out: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: out.append(("synchronize",)))
    monkeypatch.setattr(pinned, "_cudart", lambda: FakeCudart(out))
    monkeypatch.setattr(pinned, "_registered", {})
    monkeypatch.setattr(pinned, "_freed", [])
    return out


def test_collecting_a_pinned_tensor_makes_no_cuda_call(calls):
    t = pinned.host_empty(1000, torch.float32, pin=True)
    assert [c[0] for c in calls] == ["register"] and calls[0][2] == 4000
    assert pinned.pinned_bytes() == 4000 and pinned.is_page_locked(t)
    del t
    gc.collect()
    assert [c[0] for c in calls] == ["register"], "the finalizer called CUDA"
    assert pinned.pinned_bytes() == 0 and pinned.freed_bytes() == 4000


def test_freed_blocks_are_released_at_the_next_allocation_after_one_synchronize(calls):
    a = pinned.host_empty(1000, torch.float32, pin=True)
    b = pinned.host_empty(500, torch.bfloat16, pin=True)
    ptrs = {a.data_ptr(), b.data_ptr()}
    del a, b
    gc.collect()
    calls.clear()
    c = pinned.host_empty(10, torch.float32, pin=True)
    kinds = [k[0] for k in calls]
    assert kinds == ["synchronize", "unregister", "unregister", "register"]
    assert {k[1] for k in calls if k[0] == "unregister"} == ptrs
    assert pinned.freed_bytes() == 0 and pinned.pinned_bytes() == 40
    del c
    gc.collect()
    calls.clear()
    assert pinned.release_freed() == 40
    assert [k[0] for k in calls] == ["synchronize", "unregister"]
    assert pinned.release_freed() == 0 and [k[0] for k in calls] == ["synchronize", "unregister"]


def test_a_view_outliving_its_tensor_keeps_its_memory(calls):
    t = pinned.host_empty(1000, torch.float32, pin=True)
    t.copy_(torch.arange(1000, dtype=torch.float32))
    view = t[100:200]
    del t
    gc.collect()
    pinned.release_freed()
    torch.empty(1 << 20).fill_(7.0)          # memory handed out again would show here
    assert torch.equal(view, torch.arange(100, 200, dtype=torch.float32))


def test_unpinned_and_empty_requests_register_nothing(calls):
    assert pinned.host_empty(10, torch.float32, pin=False).numel() == 10
    assert pinned.host_empty(0, torch.float32, pin=True).numel() == 0
    assert calls == []


def test_nvme_buffer_pools_and_parameter_buffers_are_page_locked_when_asked(calls):
    """DeepSpeed pins its swap buffers: with ``pin`` (CUDA present) the NVMe optimizer's pool and the stage-3
    parameter store's aligned buffers are registered whole; without it nothing is."""
    from zero_offload.nvme.buffers import ALIGNMENT, AlignedBuffer, BufferPool
    pool = BufferPool(3, 10_000, pin=True)
    registered = [c for c in calls if c[0] == "register"]
    assert len(registered) == 3 and all(c[2] == pool.buffers[0].nbytes + ALIGNMENT for c in registered)
    assert all(b.raw.data_ptr() % ALIGNMENT == 0 for b in pool.buffers)
    calls.clear()
    AlignedBuffer(10_000)
    BufferPool(2, 10_000)
    assert calls == []
