"""Memory per rank, measured from the tensors the engine holds (and on CUDA from the allocator)."""
import pytest
import torch

import zero_offload
from dist_utils import run_ranks
from reference import engine_config
from toy_model import batch, make_model
from zero_offload.zero.flat import ALIGNMENT

N_PARAMS = sum(p.numel() for p in make_model().parameters())


def _breakdown(config):
    engine = zero_offload.initialize(make_model(), config)
    x, y = batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    return engine.memory_breakdown(), len(engine.optimizer.param_groups)


def _check_partitioned(breakdown, groups, ws, offload):
    per_rank = N_PARAMS / ws
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        numel = breakdown[kind]["numel"]
        assert per_rank <= numel < per_rank + groups * ALIGNMENT, (kind, numel, per_rank)
        assert breakdown[kind]["bytes"] == 4 * numel
        assert breakdown[kind]["side"] == ("host" if offload else "device")


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "none"), (1, "cpu"), (2, "cpu")])
def test_two_ranks_hold_half_the_optimizer_states(stage, offload):
    cfg = engine_config(stage, offload, 1, precision="bf16", ws=2)
    for breakdown, groups in run_ranks(_breakdown, 2, cfg):
        _check_partitioned(breakdown, groups, 2, offload == "cpu")
        if stage == 2:
            assert breakdown["grads"]["numel"] == 0          # no full gradient is kept
            assert breakdown["grad_partition"]["numel"] < N_PARAMS / 2 + groups * ALIGNMENT


def test_offload_leaves_only_parameters_and_buckets_on_the_device():
    cfg = engine_config(2, "cpu", 1, precision="bf16", bucket=1000)
    breakdown, _ = _breakdown(cfg)
    device_kinds = {k for k, v in breakdown.items() if v["side"] == "device" and v["bytes"]}
    assert device_kinds == {"params", "buckets"}
    assert breakdown["params"]["bytes"] < 2 * (N_PARAMS + ALIGNMENT)    # 16-bit parameters
    # Buckets alive at once: those in flight, the one filling, those spanned by the largest parameter and
    # those waiting for a late (tied) parameter -- a fraction of the full 16-bit gradient it replaces.
    assert 0 < breakdown["buckets"]["bytes"] < 0.5 * breakdown["params"]["bytes"]


def test_stage0_keeps_everything_replicated():
    breakdown, groups = _breakdown(engine_config(0, "none", 1))
    assert breakdown["exp_avg"]["numel"] >= N_PARAMS
    assert breakdown["master"]["bytes"] == 0    # fp32 on the device: the parameters are the masters


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_holds_only_parameters_and_buckets():
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    cfg = engine_config(2, "cpu", 1, precision="bf16", bucket=1000)
    engine = zero_offload.initialize(make_model(), cfg)
    x, y = batch(0, 2)
    engine.backward(engine(x.cuda(), y.cuda()))
    engine.step()
    held = torch.cuda.memory_allocated() - base
    breakdown = engine.memory_breakdown()
    assert held <= breakdown["params"]["bytes"] + breakdown["buckets"]["bytes"] + 64 * 1024
