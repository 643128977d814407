"""Engine.backward(end_accumulation=True): a shorter last accumulation (as transformers' Trainer and Lightning
make at an epoch's end) steps on exactly the gradients of its own micro-batches, against plain PyTorch AdamW,
at stage 0, at stage 2 with the optimizer offloaded (partitions overwritten on a first micro-step) and at
stage 3; the next accumulation starts afresh."""
import pytest
import torch

import zero_offload
from toy_model import batch, make_model

GAS, MICRO, LR = 3, 2, 1e-3
# Micro-batches per optimizer step: a full accumulation, a short one of 1, a short one of 2, a full one.
PLAN = [3, 1, 2, 3]


def _reference():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    i = 0
    for n in PLAN:
        opt.zero_grad()
        for _ in range(n):
            x, y = batch(i, MICRO)
            (model(x, y) / GAS).backward()      # each micro-batch divided by the configured accumulation
            i += 1
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("zero", [{"stage": 0}, {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                  {"stage": 3, "stage3_param_persistence_threshold": 0}])
def test_shorter_accumulations_match_adamw(zero):
    engine = zero_offload.initialize(make_model(), {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}})
    i = 0
    for n in PLAN:
        for k in range(n):
            x, y = batch(i, MICRO)
            engine.backward(engine(x, y), end_accumulation=k == n - 1)
            i += 1
            assert engine.is_gradient_accumulation_boundary() == (k == n - 1)
            engine.step()
    assert engine.global_step == len(PLAN) and engine.micro_steps == len(PLAN) * GAS
    ref = _reference()
    got = engine.full_state_dict()
    assert max((got[k] - v).abs().max().item() for k, v in ref.items()) <= 1e-5
