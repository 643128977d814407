"""The host step's walk order (issue 27): `CPUAdam.step(order=...)` and the delayed step's `BufferLease`.

- a step in any order of work items (the engine's: the next forward's, or from the end under the delayed update)
  equals the step over every parameter whole, bitwise; ``on_chunk`` reports the items' offsets;
- an order that misses part of a parameter, covers a part twice or names a range outside it is refused by name;
- a lease releases from the end only, and a wait blocks until its offset is released (and not longer).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from zero_offload.optim import CPUAdam
from zero_offload.offload.handles import DONE
from zero_offload.offload.buffer_lease import BufferLease


def _stepped(order=None, on_chunk=None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.randn(1000), torch.randn(300)]
    grads = [torch.randn(1000).to(torch.bfloat16), torch.randn(300).to(torch.bfloat16)]
    opt = CPUAdam([{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.0}], lr=1e-2,
                  weight_decay=0.1, chunk_size=100)
    for _ in range(2):
        opt.step(grads=[[grads[0]], [grads[1]]], order=order, on_chunk=on_chunk)
    return params


def test_any_order_of_work_items_steps_bitwise_as_whole_parameters():
    whole = _stepped()
    backwards = [(1, 0, 200, 300), (1, 0, 0, 200), (0, 0, 500, 1000), (0, 0, 0, 500)]
    seen = []
    walked = _stepped(backwards, on_chunk=lambda g, p, lo, hi: seen.append((g, lo, hi)))
    assert all(torch.equal(a, b) for a, b in zip(whole, walked))
    assert seen[0] == (1, 200, 300) and seen[-1] == (0, 400, 500)     # chunks of 100 inside each item, in order


@pytest.mark.parametrize("order,fault", [
    ([(0, 0, 0, 1000)], r"\(group, param\) \(1, 0\) 0 elements of 300"),                       # group 1 missing
    ([(0, 0, 0, 600), (0, 0, 500, 1000), (1, 0, 0, 300)], r"\(0, 0\) 1100 elements of 1000"),  # overlap
    ([(0, 0, 0, 1001), (1, 0, 0, 300)], r"order item \(0, 0, 0, 1001\) is not a range"),
    ([(2, 0, 0, 10)], r"order item \(2, 0, 0, 10\)"),
])
def test_a_bad_order_is_refused_by_name(order, fault):
    with pytest.raises(ValueError, match=fault):
        _stepped(order)


def test_a_lease_releases_from_the_end_and_a_wait_ends_at_its_offset():
    lease = BufferLease(100)
    lease.release(60, 100, DONE)
    assert lease.wait(60) is DONE and not lease.released
    with pytest.raises(RuntimeError, match=r"chunk \[0, 30\) released out of order \(released from 60\)"):
        lease.release(0, 30, DONE)
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(lease.wait(20)))
    waiter.start()
    time.sleep(0.05)
    lease.release(40, 60, DONE)
    time.sleep(0.05)
    assert not woke                          # [20, 40) is still the step's
    lease.release_all()
    waiter.join(5)
    assert woke == [DONE] and lease.released
