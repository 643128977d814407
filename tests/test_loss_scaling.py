"""fp16 dynamic loss scaling as DeepSpeed does it: skipped steps, hysteresis, window, minimum."""
import math

import torch

import zero_offload
from reference import engine_config
from toy_model import batch, make_model
from zero_offload.config import Config
from zero_offload.precision import LossScaler


def _scaler(**fp16):
    return LossScaler(Config.load({"train_batch_size": 1, "fp16": {"enabled": True, **fp16}}))


def test_hysteresis_then_halving_then_floor():
    s = _scaler(initial_scale_power=4, hysteresis=2, min_loss_scale=4)
    s.update(True)
    assert s.scale == 16            # first overflow spends hysteresis
    s.update(True)
    assert s.scale == 8             # second halves
    s.update(True)
    assert s.scale == 4
    s.update(True)
    assert s.scale == 4             # never below min_loss_scale


def test_doubles_after_window_of_clean_steps():
    s = _scaler(initial_scale_power=4, loss_scale_window=3, hysteresis=1)
    s.update(True)
    assert s.scale == 8
    for _ in range(2):
        s.update(False)
    assert s.scale == 8
    s.update(False)
    assert s.scale == 16            # 3 clean steps since the overflow


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
