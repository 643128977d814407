"""Reductions start while backward is still running (ZeRO-2 / DDP-style overlap of communication)."""
import time

import pytest

import zero_offload
from dist_utils import run_ranks
from reference import MICRO, engine_config
from toy_model import batch, make_model


def _first_launch_vs_backward_end(config):
    from zero_offload.comm import DistContext
    launches = []       # perf_counter() of each reduction launched in the last accumulation's micro-steps

    def timed(collective):
        def launch(self, *args, **kwargs):
            launches.append(time.perf_counter())
            return collective(self, *args, **kwargs)
        return launch
    DistContext.reduce, DistContext.all_reduce = timed(DistContext.reduce), timed(DistContext.all_reduce)
    engine = zero_offload.initialize(make_model(), config)
    last_grad = []
    # wte is used first in forward (and tied to the head), so its gradient is the last one backward makes;
    # registered after the engine's hooks, this one runs after the engine has handled wte.
    engine.module.wte.weight.register_post_accumulate_grad_hook(lambda p: last_grad.append(time.perf_counter()))
    gas = engine.gradient_accumulation_steps
    for k in range(gas):
        x, y = batch(k, MICRO)
        if k == gas - 1:
            launches.clear()        # the boundary micro-step's launches, as stages 0-1 reduce only there
        engine.backward(engine(x, y))
    launches = list(launches)
    engine.step()
    return launches, last_grad[-1]


@pytest.mark.parametrize("stage,gas", [(0, 1), (1, 2), (2, 1), (2, 2)])
def test_first_reduction_starts_before_backward_ends(stage, gas):
    cfg = engine_config(stage, "cpu" if stage else "none", gas, precision="bf16", ws=2, bucket=2048)
    for launches, backward_end in run_ranks(_first_launch_vs_backward_end, 2, cfg):
        early = [t for t in launches if t < backward_end]
        assert len(launches) > 2
        assert early, "every reduction was launched after backward had finished"
        assert len(early) >= len(launches) // 2


def test_overlap_comm_false_still_matches():
    """overlap_comm = false waits for each bucket at once; results are the same."""
    from reference import engine_run
    a = engine_run(engine_config(2, "cpu", 1, ws=1))
    cfg = engine_config(2, "cpu", 1, ws=1)
    cfg["zero_optimization"]["overlap_comm"] = False
    b = engine_run(cfg)
    assert a[2] == b[2]
