"""Stage-2 bucket buffers come from a fixed pool: allocated once at `initialize`, sized as the memory model says,
never grown while gradients arrive in launch order (a parameter larger than a bucket included), and grown with a
warning -- still exact against AdamW -- when they do not."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import zero_offload
from reference import engine_config, train_step
from toy_model import make_model
from zero_offload.estimate import estimate_memory

GROWS = "bucket pool grows"


def _pool_bytes(engine) -> int:
    return engine.memory_breakdown()["buckets"]["bytes"]


def _steps_without_growth(model, config, steps=4) -> list[int]:
    """The pool's bytes at `initialize` and after each step; fails on a growth warning."""
    engine = zero_offload.initialize(model, config)
    seen = [_pool_bytes(engine)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{GROWS}")
        for step in range(steps):
            train_step(engine, step, 0, 1)
            seen.append(_pool_bytes(engine))
    return seen


@pytest.mark.parametrize("overlap", (True, False))
@pytest.mark.parametrize("offload", ("none", "cpu"))
def test_pool_is_allocated_once_and_counted_by_the_memory_model(overlap, offload):
    config = engine_config(2, offload, gas=2, precision="bf16", bucket=500, overlap_comm=overlap)
    seen = _steps_without_growth(make_model(), config)
    expected = (4 if overlap else 2) * 500 * 2          # bf16 buffers of the largest bucket
    assert seen == [expected] * len(seen)
    assert estimate_memory(make_model(), config, 1, accelerator=False).device["buckets"] == expected


def test_a_parameter_spanning_many_buckets_takes_no_more_buffers():
    """wte (48 x 32) spans 24 buckets of 64 elements and arrives in one hook: each bucket is launched before the
    next takes a buffer, so the pool of 4 suffices."""
    seen = _steps_without_growth(make_model(), engine_config(2, "cpu", gas=2, bucket=64))
    assert seen == [4 * 64 * 4] * len(seen)


def test_fewer_buckets_than_the_pool_allocate_no_more_than_the_buckets():
    config = engine_config(2, "cpu", bucket=10 ** 8)
    seen = _steps_without_growth(make_model(), config, steps=2)
    numel = sum(p.numel() for p in make_model().parameters())     # one bucket holds the whole model
    assert seen[0] == numel * 4
    assert estimate_memory(make_model(), config, 1, accelerator=False).device["buckets"] == seen[0]


class _UsedBackwards(nn.Module):
    """Layers applied in the reverse of their registration: backward produces gradients in registration order,
    the opposite of the bucket launch order, so every bucket fills before the first one can go."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x, y):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return ((x - y) ** 2).mean()


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)


def test_gradients_out_of_launch_order_grow_the_pool_with_a_warning_and_stay_exact():
    config = engine_config(2, "cpu", bucket=272)       # one layer (16 x 16 + 16) per bucket
    engine = zero_offload.initialize(_UsedBackwards(), config)
    before = _pool_bytes(engine)
    reference = _UsedBackwards()
    opt = torch.optim.AdamW(reference.parameters(), lr=config["optimizer"]["params"]["lr"],
                            weight_decay=config["optimizer"]["params"]["weight_decay"])
    sizes = []
    for step in range(3):
        x, y = _batch(step)
        if step == 0:
            with pytest.warns(UserWarning, match=GROWS):
                engine.backward(engine(x, y))
        else:
            engine.backward(engine(x, y))
        engine.step()
        sizes.append(_pool_bytes(engine))
        opt.zero_grad()
        reference(x, y).backward()
        opt.step()
    assert sizes[0] > before and sizes == [sizes[0]] * 3          # grown once, for good
    for (name, p), q in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
