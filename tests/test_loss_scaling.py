"""fp16 dynamic loss scaling as DeepSpeed does it: skipped steps, hysteresis, window, minimum."""
import math

import pytest
import torch

import zero_offload
from reference import engine_config
from toy_model import batch, make_model
from zero_offload.config import Config
from zero_offload.precision import LossScaleError, LossScaler


def _scaler(**fp16):
    return LossScaler(Config.load({"train_batch_size": 1, "fp16": {"enabled": True, **fp16}}))


def test_hysteresis_then_halving_then_floor_then_error():
    s = _scaler(initial_scale_power=4, hysteresis=2, min_loss_scale=4)
    s.update(True)
    assert s.scale == 16            # first overflow spends hysteresis
    s.update(True)
    assert s.scale == 8             # second halves
    s.update(True)
    assert s.scale == 4             # never below min_loss_scale
    with pytest.raises(LossScaleError, match=r"fp16.min_loss_scale = 4"):
        s.update(True)              # overflowing at the minimum: DeepSpeed raises rather than skip forever


def test_doubles_after_window_of_clean_steps():
    s = _scaler(initial_scale_power=4, loss_scale_window=3, hysteresis=1)
    s.update(True)
    assert s.scale == 8
    for _ in range(3):
        s.update(False)
    assert s.scale == 8             # DeepSpeed 0.19.8 (PR 6976) does not count the first clean step
    s.update(False)
    assert s.scale == 16


# (overflow sequence, expected scale after each update) for DeepSpeed 0.19.8's DynamicLossScaler, worked out
# by hand from its update_scale (stable_interval = iterations since the last overflow - 1).
O, C = True, False
TABLE = [
    # initial 16, window 3, hysteresis 1: no overflow doubles at iteration 3 (stable_interval 3), then every 3
    (dict(initial_scale_power=4, loss_scale_window=3, hysteresis=1),
     [C, C, C, C, C, C, C], [16, 16, 16, 32, 32, 32, 64]),
    # hysteresis 2: the first overflow spends it, the second halves; refilled only when the scale doubles
    (dict(initial_scale_power=4, loss_scale_window=3, hysteresis=2),
     [C, O, O, C, C, C, C, O], [16, 16, 8, 8, 8, 8, 16, 16]),
    # consecutive_hysteresis refills after every clean step: alternating overflows never halve
    (dict(initial_scale_power=4, loss_scale_window=2, hysteresis=2, consecutive_hysteresis=True),
     [O, C, O, C, O, O], [16, 16, 16, 16, 16, 8]),
    # window 1: doubles on every clean step but the first after an overflow
    (dict(initial_scale_power=2, loss_scale_window=1, hysteresis=1),
     [C, C, O, C, C, C], [4, 8, 4, 4, 8, 16]),
]


@pytest.mark.parametrize("fp16,overflows,scales", TABLE)
def test_loss_scale_sequence_matches_deepspeed_0_19_8(fp16, overflows, scales):
    s = _scaler(**fp16)
    got = []
    for o in overflows:
        s.update(o)
        got.append(s.scale)
    assert got == scales


def test_loss_scale_side_by_side_with_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)   # it logs on rank 0; no process group here
    pattern = [False] * 7 + [True] + [False] * 3 + [True, True] + [False] * 9 + [True] * 3 + [False] * 5
    for window, hysteresis, consecutive in [(1, 1, False), (3, 2, False), (2, 3, True), (5, 1, False)]:
        ours = _scaler(initial_scale_power=8, loss_scale_window=window, hysteresis=hysteresis,
                       consecutive_hysteresis=consecutive, min_loss_scale=1)
        theirs = loss_scaler.DynamicLossScaler(init_scale=2**8, scale_window=window, min_scale=1,
                                               delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
        for step, overflow in enumerate(pattern):
            ours.update(overflow)
            theirs.update_scale(overflow)
            assert (ours.scale, ours.hysteresis) == (theirs.cur_scale, theirs.cur_hysteresis), (window, step)
    ours = _scaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    theirs = loss_scaler.DynamicLossScaler(init_scale=2, scale_window=1000, min_scale=1, delayed_shift=1,
                                           consecutive_hysteresis=False)
    ours.update(True)
    theirs.update_scale(True)
    with pytest.raises(Exception, match="minimum"):
        theirs.update_scale(True)
    with pytest.raises(LossScaleError, match="minimum"):
        ours.update(True)


def test_static_scale_never_changes():
    s = _scaler(loss_scale=128.0)
    s.update(True)
    s.update(False)
    assert s.scale == 128.0 and not s.dynamic


def test_bf16_scale_is_one():
    s = LossScaler(Config.load({"train_batch_size": 1, "bf16": {"enabled": True}}))
    assert s.scale == 1.0 and not s.enabled


def test_injected_inf_skips_step_and_keeps_parameters():
    cfg = engine_config(2, "cpu", 1, precision="fp16")
    cfg["fp16"].update(initial_scale_power=10, hysteresis=2)
    engine = zero_offload.initialize(make_model(), cfg)
    x, y = batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()                                    # one clean step
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    masters = engine.full_state_dict()
    lr_before = engine.get_lr()
    scales = []
    for step in (1, 2):
        x, y = batch(step, 2)
        engine.backward(engine(x, y) * math.inf)    # every gradient becomes inf/nan
        engine.step()
        scales.append(engine.loss_scale)
        for n, p in engine.module.named_parameters():
            assert torch.equal(p, before[n]), n
        for n, m in engine.full_state_dict().items():
            assert torch.equal(m, masters[n]), n
    assert scales == [1024.0, 512.0]                # hysteresis 2: first overflow keeps, second halves
    assert engine.skipped_steps == 2 and engine.global_step == 3
    assert engine.get_lr() == lr_before
    x, y = batch(3, 2)
    engine.backward(engine(x, y))
    engine.step()                                    # training resumes after the skipped steps
    assert any(not torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
