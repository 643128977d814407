"""The delayed parameter update (ZeRO-Offload Sec. 5.2) is exact against plain-torch AdamW run on the same
schedule: after the warm-up, the gradient of step u is taken at the parameters of step u-2.
fp32, stages 2 and 3 (3 with the parameters offloaded too), accumulation 1 and 3, world size 1 and 2."""
import itertools
import os
import tempfile

import pytest
import torch

import zero_offload
from dist_utils import run_ranks
from reference import LR, MICRO, WD, assert_norms_match, engine_config, engine_runs, reference_run
from toy_model import batch, make_model

WARMUP, STEPS, ATOL = 2, 6, 1e-5
CASES = list(itertools.product((2, 3), (1, 3)))


def dpu_config(stage, gas, ws, warmup=WARMUP, **extra):
    cfg = engine_config(stage, "cpu", gas, ws=ws)
    cfg["zero_optimization"]["offload_optimizer"].update(delayed_param_update=True, dpu_warmup_steps=warmup)
    if stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    cfg["zero_optimization"].update(extra)
    return cfg


def dpu_reference(gas, ws, warmup=WARMUP, steps=STEPS, clip=0.0):
    """AdamW over the global batch where step u's gradient is taken at the parameters after step u-2 once
    u > warmup (the parameters after step u-1 before), clipped by clip_grad_norm_ when ``clip`` > 0.
    Returns (masters, losses, norms): norms as clip_grad_norm_ returns them."""
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD)
    history = [[m.detach().clone() for m in masters]]
    losses, norms = [], []
    for u in range(steps):
        use = history[-2] if u >= warmup + 1 else history[-1]
        with torch.no_grad():
            for p, v in zip(model.parameters(), use):
                p.copy_(v)
        model.zero_grad()
        x, y = batch(u, MICRO * gas * ws)
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, clip if clip > 0 else float("inf"))))
        opt.step()
        history.append([m.detach().clone() for m in masters])
    return dict(zip(names, history[-1])), losses, norms


@pytest.fixture(scope="module")
def results():
    out = {}
    for ws in (1, 2):
        configs = [dpu_config(stage, gas, ws) for stage, gas in CASES]
        per_case = engine_runs(configs, STEPS) if ws == 1 else run_ranks(engine_runs, 2, configs, STEPS)[0]
        out.update({(ws, *case): res for case, res in zip(CASES, per_case)})
    return out


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("stage,gas", CASES)
def test_delayed_update_matches_its_schedule(results, ws, stage, gas):
    ref, ref_losses, _ = dpu_reference(gas, ws)
    masters, _params, losses = results[(ws, stage, gas)]
    for name, value in ref.items():
        assert (masters[name] - value).abs().max().item() <= ATOL, name
    assert losses == pytest.approx(ref_losses, abs=1e-5)


def test_the_schedule_differs_from_plain_adamw():
    """Staleness must change the result, or the comparison above could not tell DPU from no DPU."""
    delayed, _, _ = dpu_reference(1, 1)
    plain, _ = reference_run(steps=STEPS)
    assert max((delayed[n] - plain[n]).abs().max().item() for n in plain) > 1e-4


@pytest.mark.parametrize("ws", (1, 2))
def test_delayed_update_clips_as_clip_grad_norm(ws):
    """Clipping under the delayed update: each step's norm is taken on its own (stale-weight) gradients and
    equals clip_grad_norm_'s; the masters follow clip_grad_norm_ + AdamW on the same schedule."""
    cases = [(2, 1), (3, 3)]
    configs = [dpu_config(stage, gas, ws) for stage, gas in cases]
    for cfg in configs:
        cfg["gradient_clipping"] = 1.0
    res = engine_runs(configs, STEPS, True) if ws == 1 else run_ranks(engine_runs, 2, configs, STEPS, True)[0]
    for (stage, gas), (masters, _params, losses, norms) in zip(cases, res):
        ref, ref_losses, ref_norms = dpu_reference(gas, ws, clip=1.0)
        assert_norms_match(norms, ref_norms)
        for name, value in ref.items():
            assert (masters[name] - value).abs().max().item() <= ATOL, (stage, gas, name)
        assert losses == pytest.approx(ref_losses, abs=1e-5)


def _train(engine, steps, start=0):
    for step in range(start, steps):
        x, y = batch(step, MICRO)
        engine.backward(engine(x, y))
        engine.step()


@pytest.mark.parametrize("stage", (2, 3))
def test_checkpoint_under_dpu_resumes_exactly(stage):
    """A run that saves mid-way (the update in flight is flushed) and goes on equals a run resumed from it."""
    cfg = dpu_config(stage, 1, 1, warmup=1)
    with tempfile.TemporaryDirectory() as d:
        live = zero_offload.initialize(make_model(), cfg)
        _train(live, 4)
        live.save_checkpoint(d, tag="mid")
        _train(live, 7, start=4)
        resumed = zero_offload.initialize(make_model(seed=5), cfg)
        _train(resumed, 2)                         # a pending update that the load must drop
        resumed.load_checkpoint(d, tag="mid")
        _train(resumed, 7, start=4)
        a, b = live.full_state_dict(), resumed.full_state_dict()
        assert os.path.isdir(os.path.join(d, "mid"))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_dpu_needs_the_optimizer_offloaded():
    cfg = engine_config(2, "none", 1)
    cfg["zero_optimization"]["offload_optimizer"]["delayed_param_update"] = True
    with pytest.raises(zero_offload.ConfigError, match="offload_optimizer.delayed_param_update"):
        zero_offload.Config.load(cfg)


def test_dpu_background_failure_is_raised_in_the_training_thread():
    engine = zero_offload.initialize(make_model(), dpu_config(2, 1, 1, warmup=0))

    def broken(*args, **kwargs):
        raise OSError("disk on fire")
    engine.host_step.delayed._detached_step = broken
    _train(engine, 1)
    with pytest.raises(RuntimeError, match="background thread") as info:
        engine.full_state_dict()
    assert isinstance(info.value.__cause__, OSError)
