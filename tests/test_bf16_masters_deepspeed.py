"""bf16 master weights train what DeepSpeed 0.19.8 trains with the same config (``bf16_master_weights_and_grads``,
stage 2, ``offload_optimizer.device = cpu``: its ``DeepSpeedCPUAdam`` over bf16 master partitions), step by step.

DeepSpeed runs 5 steps on the CPU accelerator and saves a checkpoint after each; from each checkpoint this engine
(same config) loads DeepSpeed's masters, moments and schedule and takes the next step on the same batch. Both then
start from the same bf16 masters, fp32 moments and (the same forward and backward on the same weights) bf16
gradients, and differ only in how each computes the AdamW update in fp32 and where the result rounds to bf16.

The bound per element, derived (u = 2**-24, t the step, A the update's size |w_new - w_old (1 - lr wd)|, at most
|w_new - w_old| + lr wd |w_old|):
- DeepSpeed keeps beta1**t and beta2**t in fp32 (betas rounded to fp32, multiplied t times), so 1 - beta**t carries a
  relative error up to (2t + 1) u beta**t / (1 - beta**t); its step size takes the bias corrections as 1 / bc1 and
  1 / sqrt(bc2): a relative error in the update up to
  eps_t = [(2t + 1) (beta1**t / (1 - beta1**t) + beta2**t / (2 (1 - beta2**t))) + 8] u
  (the 8 covers the dozen fp32 operations of either kernel; ours takes the corrections in double);
- the bf16 gradients are bitwise equal: the same forward and backward on the same weights, with DeepSpeed's rank's
  thread count (bf16 sums in a backward depend on how many threads share them);
- each rounds its fp32 result to the nearest bf16: when the two fp32 results straddle a rounding boundary, one bf16
  ulp apart.
So |w_ours - w_ds| <= ulp_bf16 + eps_t (A + ulp_bf16) + 4 u |w_old|: the bf16 rounding of one step per step, plus
DeepSpeed's fp32 bias correction's share of the update (2e-5 of it at t = 5 with beta2 = 0.999).
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import zero_offload
from deepspeed_peer import LR, WD, batches, groups, loss_of, make_model, needs_deepspeed, our_config, ds_config
from dist_utils import run_ranks
from reference16 import ulp

pytestmark = needs_deepspeed
STEPS, BETAS, U = 5, (0.9, 0.999), 2.0**-24


def _bf16(config: dict) -> dict:
    config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True}
    return config


def _deepspeed_steps(path: str) -> list[dict]:
    """On one gloo rank: DeepSpeed's own run (its CPU Adam), a checkpoint tagged ``s{k}`` after step k."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    cfg = _bf16(ds_config(2, True))
    cfg["optimizer"]["params"].pop("torch_adam")
    cfg["zero_force_ds_cpu_optimizer"] = True          # bf16 masters need DeepSpeedCPUAdam
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups(model), config=cfg)
    weights = []
    for k, x in enumerate(batches(STEPS)):
        engine.backward(loss_of(engine, x))
        engine.step()
        engine.save_checkpoint(path, tag=f"s{k}")
        weights.append({n: p.detach().float().clone() for n, p in engine.module.named_parameters()})
    return weights


def _update_error(t: int) -> float:
    b1, b2 = BETAS
    return ((2 * t + 1) * (b1**t / (1 - b1**t) + b2**t / (2 * (1 - b2**t))) + 8) * U


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ds_bf16"))
    return path, run_ranks(_deepspeed_steps, 1, path)[0]


@pytest.mark.parametrize("k", range(1, STEPS))
def test_one_step_from_deepspeeds_state_is_deepspeeds_step(deepspeed_run, k):
    path, theirs = deepspeed_run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as DeepSpeed's rank ran (`dist_utils`): bf16 backward sums in the same order
    try:
        _check_step(path, theirs, k)
    finally:
        torch.set_num_threads(threads)


def _check_step(path: str, theirs: list[dict], k: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make_model()
        engine = zero_offload.initialize(model, _bf16(our_config(2, True)), groups(model))
        engine.load_checkpoint(path, tag=f"s{k - 1}")
    try:
        lr = engine.get_lr()[0]
        engine.backward(loss_of(engine, batches(STEPS)[k]))
        engine.step()
        mine = {n: p.detach().float() for n, p in engine.module.named_parameters()}
    finally:
        engine.close()
    eps, before = _update_error(k + 1), theirs[k - 1]
    flips = 0
    for name, w in mine.items():
        ds = theirs[k][name]
        assert torch.equal(w, w.bfloat16().float()), f"{name}: masters are not bf16 values"
        width = torch.maximum(ulp(w, torch.bfloat16), ulp(ds, torch.bfloat16))
        update = (w - before[name]).abs() + lr * WD * before[name].abs()     # >= A, decayed or not
        bound = width + eps * (update + width) + 4 * U * before[name].abs()
        worst = ((w - ds).abs() / bound).max().item()
        assert worst <= 1.0, f"step {k}: {name} off by {worst:.3g} x the bound"
        flips += int((w != ds).sum())
    # A rounding boundary straddled is rare: most elements are bitwise DeepSpeed's.
    assert flips <= sum(v.numel() for v in mine.values()) // 100, flips
    assert lr <= LR
