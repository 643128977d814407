"""Issue 20, section 4, checked without GPUs: which device a rank computes on (LOCAL_RANK binds it whoever created
the process group), and where the module-level collectives run CPU tensors (through the GPU under an NCCL-only
group, as they are under gloo or a ``cpu:gloo,cuda:nccl`` group). `benchmarks/gpu_validate.py`'s ``two_gpus``
section runs `init_sharded` under an NCCL-only group on 2 GPUs."""
import pytest
import torch
import torch.distributed as dist

from zero_offload import comm
from zero_offload.comm import choose_device, collective_device


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_local_rank_binds_the_device_whoever_made_the_group(two_gpus):
    assert choose_device("nccl", True, {"LOCAL_RANK": "1"}) == torch.device("cuda", 1)
    assert choose_device("cpu:gloo,cuda:nccl", True, {"LOCAL_RANK": "1"}) == torch.device("cuda", 1)
    assert choose_device(None, True, {"LOCAL_RANK": "1"}) == torch.device("cuda", 1)     # one process, torchrun
    # Without LOCAL_RANK: the device the user set (torch.cuda.set_device before initialize, as with DDP).
    assert choose_device("nccl", True, {}) == torch.device("cuda", 0)
    # gloo reduces CPU tensors only; no CUDA at all: the CPU.
    assert choose_device("gloo", True, {"LOCAL_RANK": "1"}) == torch.device("cpu")
    assert choose_device("nccl", False, {"LOCAL_RANK": "1"}) == torch.device("cpu")


@pytest.mark.parametrize("value,message", [("one", "LOCAL_RANK='one' must be an integer"),
                                           ("2", "LOCAL_RANK=2 names a GPU this process does not see")])
def test_a_bad_local_rank_is_named(two_gpus, value, message):
    with pytest.raises(ValueError, match=message):
        choose_device("nccl", True, {"LOCAL_RANK": value})


def test_create_binds_local_rank_under_a_group_the_user_made(two_gpus, monkeypatch):
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ctx = comm.DistContext.create()
    assert ctx.device == torch.device("cuda", 1) and bound == [torch.device("cuda", 1)]
    assert (ctx.rank, ctx.world_size) == (1, 2)


@pytest.mark.parametrize("backend,moved", [("nccl", True), ("cpu:gloo,cuda:nccl", False), ("gloo", False)])
def test_cpu_tensors_go_through_the_gpu_only_under_an_nccl_only_group(two_gpus, monkeypatch, backend, moved):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    where = collective_device(torch.zeros(4))
    assert where == (torch.device("cuda", 0) if moved else torch.device("cpu"))


def test_collectives_on_one_process_need_no_group():
    assert collective_device(torch.zeros(2)) == torch.device("cpu")       # no process group: as it is
    t = torch.arange(4.0)
    comm.broadcast_object(t)            # world size 1: nothing to do
    assert comm.gather_objects(3) == [3]
