"""DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, stepped by the engine with the optimizer."""
import math

import pytest

import zero_offload
from toy_model import batch, make_model


def _lrs(scheduler, steps, lr=1e-3):
    engine = zero_offload.initialize(make_model(), {
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "scheduler": scheduler, "zero_optimization": {"stage": 1}})
    seen = [engine.get_lr()[0]]
    for step in range(steps):
        x, y = batch(step, 2)
        engine.backward(engine(x, y))
        engine.step()
        seen.append(engine.get_lr()[0])
    return seen


def test_warmup_lr_log():
    lrs = _lrs({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                "warmup_num_steps": 4}}, 6)
    expected = [0.0] + [0.01 * math.log(i + 1) / math.log(4) for i in range(4)] + [0.01, 0.01]
    assert lrs == pytest.approx(expected)


def test_warmup_decay_linear():
    lrs = _lrs({"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 2,
                                                     "warmup_type": "linear", "total_num_steps": 6}}, 6)
    assert lrs == pytest.approx([0.0, 0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025])


def test_warmup_cosine():
    lrs = _lrs({"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                      "warmup_type": "linear", "cos_min_ratio": 0.1}}, 6,
               lr=0.02)
    def cos(step):
        progress = min(1.0, (step - 2 + 1) / 4)
        return 0.02 * (0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2)
    assert lrs == pytest.approx([0.0, 0.0, 0.01] + [cos(s) for s in range(2, 6)])


def test_no_scheduler_keeps_lr():
    engine = zero_offload.initialize(make_model(), {"train_batch_size": 2,
                                                    "optimizer": {"params": {"lr": 0.005}}})
    assert engine.get_lr() == [0.005]


def test_warmup_lr_defaults_to_the_optimizer_lr_per_group_as_deepspeed():
    """DeepSpeed 0.19.8's WarmupLR: warmup_max_lr=None warms each param group up to its own lr."""
    lrs = _lrs({"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}}, 3, lr=0.004)
    assert lrs == pytest.approx([0.0, 0.0, 0.002, 0.004])
    model = make_model()
    groups = [{"params": [p for n, p in model.named_parameters() if "ln" in n], "lr": 0.01},
              {"params": [p for n, p in model.named_parameters() if "ln" not in n]}]
    engine = zero_offload.initialize(model, {
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}}},
        model_parameters=groups)
    for step in range(3):
        x, y = batch(step, 2)
        engine.backward(engine(x, y))
        engine.step()
    assert engine.get_lr() == pytest.approx([0.01, 0.002])
