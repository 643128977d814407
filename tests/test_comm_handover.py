"""The tensors given to a CPU collective stay referenced from Python until the backend lets go of them
(`zero_offload.comm.handover`).

The abort it prevents: gloo's worker thread drops its reference to a collective's tensors after the caller's
``wait`` returned, and with it (torch >= 2.10) one to their Python objects, which takes the GIL; during interpreter
exit it cannot, and a two-rank script that returns from ``main`` aborted with "terminate called without an active
exception" now and then (`test_clean_exit.py` and `tests/gloo_exit_race.py` saw it; BENCHMARKS.md has the
rates before and after). The race itself is rare, so these tests check what closes it: every CPU tensor that a
collective of `zero_offload.comm` gives torch.distributed is one the hold keeps while the backend refers to it (a
view stands in for gloo's late reference), and `settle` returns once the backend has let go, and not before.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from zero_offload import comm
from zero_offload.comm import handover as comm_handover
from zero_offload.comm import DistContext

TESTS = Path(__file__).resolve().parent
SRC = Path(comm.__file__).resolve().parents[1]
# What torch.distributed is asked by zero_offload.comm; the all-gather and reduce-scatter names are bound at import.
NAMES = ("all_gather", "all_to_all_single", "broadcast", "reduce", "all_reduce")


def _every_collective(ctx: DistContext) -> dict:
    late = []        # a reference from C++ to each tensor given to torch.distributed (a view refers to its base),
                     # as gloo's worker keeps one a little after the call returns

    def recording(real):
        def call(*args, **kwargs):
            tensors = [t for a in list(args) + list(kwargs.values()) for t in (a if isinstance(a, list) else [a])
                       if isinstance(t, torch.Tensor)]
            out = real(*args, **kwargs)
            late.extend(t.view(t.shape) for t in tensors)
            return out
        return call

    real = {n: getattr(dist, n) for n in NAMES}
    real_gather, real_scatter = comm._ALL_GATHER, comm._REDUCE_SCATTER
    for n in NAMES:
        setattr(dist, n, recording(real[n]))
    comm._ALL_GATHER, comm._REDUCE_SCATTER = recording(real_gather), recording(real_scatter)
    unheld = {}         # collective -> how many of the tensors it gave the backend the hold did not keep
    try:
        rank, flat = ctx.rank, torch.arange(12.0)
        calls = {
            "all_gather_into": lambda: comm.all_gather_into(torch.zeros(4), torch.full((2,), float(rank))),
            "reduce_scatter": lambda: comm.reduce_scatter(torch.zeros(2), torch.ones(4), async_op=False),
            "all_to_all": lambda: comm.all_to_all(torch.zeros(2), torch.ones(2), [1, 1], [1, 1]),
            "broadcast": lambda: comm.broadcast(torch.ones(3), 0),
            "reduce": lambda: ctx.reduce(torch.ones(3), 1, async_op=False),
            "all_reduce": lambda: ctx.all_reduce(torch.ones(3)).wait(),
            "all_gather_partitions (one bucket)": lambda: ctx.all_gather_partitions(flat.clone(), 6, 6),
            "all_gather_partitions (buckets)": lambda: ctx.all_gather_partitions(flat.clone(), 6, 4),
            "gather_objects": lambda: comm.gather_objects({"rank": rank, "pad": "x" * (50 * rank)}),
            "broadcast_object": lambda: comm.broadcast_object(["from", rank], src=1),
        }
        results = {}
        for name, call in calls.items():
            results[name] = call()
            held = comm_handover.pending()       # the backend still refers to every tensor of this call
            if held < len(late):
                unheld[name] = len(late) - held
            late.clear()                         # the backend lets go
        settled = comm_handover.settle(timeout_s=30)
        return {"unheld": unheld, "settled": settled, "pending": comm_handover.pending(),
                "objects": results["gather_objects"], "broadcast": results["broadcast_object"]}
    finally:
        for n in NAMES:
            setattr(dist, n, real[n])
        comm._ALL_GATHER, comm._REDUCE_SCATTER = real_gather, real_scatter


def _on_two_ranks():
    return _every_collective(DistContext.create())


def test_every_cpu_collective_holds_its_tensors_until_the_backend_lets_go():
    for r in run_ranks(_on_two_ranks, 2):
        assert r["unheld"] == {}, "tensors the backend still referred to that the hold did not keep"
        assert r["settled"] and r["pending"] == 0
        assert r["objects"] == [{"rank": 0, "pad": ""}, {"rank": 1, "pad": "x" * 50}]
        assert r["broadcast"] == ["from", 1]


def test_settle_waits_for_the_backend_and_keeps_what_it_never_lets_go():
    (alias,) = comm_handover.handed(torch.ones(4))
    backend_ref = [alias.view(2, 2)]         # a reference from C++ (the view's base), as a worker's work holds
    del alias
    assert comm_handover.pending() == 1
    assert not comm_handover.settle(timeout_s=0.05) and comm_handover.pending() == 1      # kept, not freed
    threading.Timer(0.05, backend_ref.clear).start()           # the worker lets go a little later
    assert comm_handover.settle(timeout_s=30) and comm_handover.pending() == 0


def test_tensors_off_the_cpu_are_given_as_they_are():
    t = torch.ones(2)
    meta = torch.empty(2, device="meta")       # any tensor off the CPU: NCCL completes on its stream
    out = comm_handover.handed(t, meta)
    assert out[1] is meta and out[0] is not t and out[0].data_ptr() == t.data_ptr()


@pytest.mark.soak
@pytest.mark.parametrize("kind", ["partitions", "objects"])
def test_two_ranks_that_exit_right_after_their_collectives_never_abort(kind):
    """The race itself (`tests/gloo_exit_race.py`): 300 runs of two ranks that gather and exit at once; without
    the hold a few in a hundred abort (BENCHMARKS.md)."""
    runs = int(os.environ.get("ZERO_OFFLOAD_SOAK_REPS", "300"))
    out = subprocess.run([sys.executable, str(TESTS / "gloo_exit_race.py"), str(SRC), str(runs), kind],
                         capture_output=True, text=True, timeout=3000)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["aborts"] == 0
