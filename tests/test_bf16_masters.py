"""bf16 master weights and gradient partitions (DeepSpeed's ``bf16.bf16_master_weights_and_grads``) train what a
plain-torch reference that rounds the same way trains, step by step (`reference16`, lockstep).

The reference (`reference16.Reference16` with ``masters``) accumulates micro-batches in bf16 (each add rounded to
nearest, as DeepSpeed's bf16 add on the device), steps ``torch.optim.AdamW`` on fp32 copies of the engine's bf16
masters, and allows the new master to be the fp32 result rounded to bf16: half a bf16 ulp of it with nearest
rounding, one ulp with stochastic rounding, on top of `reference16`'s fp32 bound. Each step also asserts:
- every master the engine holds is a bf16 value (an engine that kept fp32 masters fails here at the first step);
- the gradient norm within `test_exact16.NORM_REL` of the reference's (an fp32 accumulation of 3 micro-batches
  differs from the bf16 one by about 2**-9 relative: 200x the bound);
- the 16-bit weights are the masters exactly.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import zero_offload
from dist_utils import run_ranks
from reference import MICRO, assert_estimated, engine_config, train_step
from reference16 import lockstep_runs
from test_exact16 import CLIP, DPU_WARMUP, STEPS, Case, case_config, check, reference_kwargs
from toy_model import make_model
from zero_offload.config import ConfigError

# (rounding, Case): stages 1-3, host states (offload 'cpu'; 'none' on this CPU device keeps them on the host too),
# accumulation 1 and 3, clipping, the delayed update, parameters on the host (stage 3), NVMe states, super_offload
# (kept without clipping, redone with it; NVMe's second bank of files), fp32 reductions.
CASES = [("nearest", Case("bf16", 1, "cpu", 1, True)), ("nearest", Case("bf16", 2, "cpu", 3, True)),
         ("nearest", Case("bf16", 2, "none", 3, False)), ("nearest", Case("bf16", 3, "cpu", 3, True)),
         ("nearest", Case("bf16", 2, "cpu", 1, False, dpu=True)), ("stochastic", Case("bf16", 2, "cpu", 3, True)),
         ("stochastic", Case("bf16", 3, "cpu", 1, False)), ("nearest", Case("bf16", 2, "nvme", 3, True)),
         ("stochastic", Case("bf16", 3, "nvme", 1, False)), ("nearest", Case("bf16", 2, "cpu", 1, False, spec=True)),
         ("stochastic", Case("bf16", 3, "cpu", 3, True, spec=True)),
         ("nearest", Case("bf16", 2, "nvme", 1, False, spec=True))]
COMM_CASES = [("nearest", Case("bf16", 3, "cpu", 3, True, comm="fp32"))]
# super_offload_fraction 0.5: half of each partition speculated in place after an undo copy.
FRACTION = ("nearest", Case("bf16", 2, "cpu", 3, False, spec=True))


def bf16_config(rounding: str, case: Case, ws: int, nvme_path: str = "", fraction: float = 1.0) -> dict:
    cfg = case_config(case, ws, nvme_path)
    if fraction < 1.0:
        cfg["zero_optimization"]["offload_optimizer"]["super_offload_fraction"] = fraction
    cfg["bf16"].update(bf16_master_weights_and_grads=True, master_weights_rounding=rounding)
    cfg["seed"] = 7
    if cfg["zero_optimization"].get("offload_param", {}).get("device") == "nvme":    # not built with bf16 masters
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return cfg


def _runs(cases, ws, nvme_path):
    args = [(bf16_config(r, c, ws, nvme_path, 0.5 if (r, c) == FRACTION and key == "f" else 1.0),
             {**reference_kwargs(c), "masters": r}, DPU_WARMUP if c.dpu else None) for key, r, c in cases]
    return lockstep_runs(args, STEPS) if ws == 1 else run_ranks(lockstep_runs, 2, args, STEPS)[0]


ONE_RANK = [("", r, c) for r, c in CASES] + [("f", *FRACTION)]
TWO_RANKS = [("", r, c) for r, c in CASES[1:2] + CASES[3:4] + CASES[5:6] + CASES[7:8] + CASES[10:11] + COMM_CASES]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nvme_bf16"))
    out = {(1, *k): s for k, s in zip(ONE_RANK, _runs(ONE_RANK, 1, path))}
    out.update({(2, *k): s for k, s in zip(TWO_RANKS, _runs(TWO_RANKS, 2, path))})
    return out


def _keys():
    return [(1, *k) for k in ONE_RANK] + [(2, *k) for k in TWO_RANKS]


@pytest.mark.parametrize("key", _keys(), ids=lambda k: f"ws{k[0]}-{k[2]}-{k[3]}" + ("-fraction0.5" if k[1] else ""))
def test_bf16_masters_lockstep(results, key):
    steps = results[key]
    check(steps)
    for u, s in enumerate(steps):
        assert s["masters_off_bf16"] == 0, f"step {u}: {s['masters_off_bf16']} masters are not bf16 values"


def _train(rounding: str, lr: float = 3e-3, steps: int = 3):
    cfg = engine_config(2, "cpu", 1, precision="bf16")
    cfg["optimizer"]["params"]["lr"] = lr
    cfg["bf16"].update(bf16_master_weights_and_grads=True, master_weights_rounding=rounding)
    cfg["seed"] = 7
    engine = zero_offload.initialize(make_model(), cfg)
    try:
        for u in range(steps):
            train_step(engine, u, 0, 1)
        return engine.full_state_dict()
    finally:
        engine.close()


class _FixedGradient(torch.nn.Module):
    """loss = sum(w * x) for a fixed x: every rank's gradient is x, and so is their average, bitwise."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4000, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return (self.w * x).sum()


def _fixed_gradient_run() -> torch.Tensor:
    cfg = engine_config(2, "cpu", 1, precision="bf16")
    cfg["bf16"].update(bf16_master_weights_and_grads=True, master_weights_rounding="stochastic")
    cfg["optimizer"]["params"]["lr"] = 1e-5
    cfg["seed"] = 7
    engine = zero_offload.initialize(_FixedGradient(), cfg)
    x = torch.randn(4000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    try:
        for _ in range(3):
            engine.backward(engine(x))
            engine.step()
        return engine.full_state_dict()["w"]
    finally:
        engine.close()


def test_stochastic_rounding_moves_what_nearest_cannot():
    """An update far below half a bf16 ulp: nearest rounding leaves every master as it was (DeepSpeed's
    behaviour with bf16 masters), stochastic rounding moves a share of them, and the same seed draws the same bits
    on 1 and 2 ranks (each element's bits are keyed by its index in the flat buffer, not in the rank's part)."""
    start = {n: p.detach().float() for n, p in make_model().to(torch.bfloat16).named_parameters()}
    lr = 1e-6                         # Adam's update is about lr; for |w| >= 1e-2 half an ulp is >= 3e-5
    big = {n: w.abs() >= 1e-2 for n, w in start.items()}
    nearest = _train("nearest", lr=lr)
    stochastic = _train("stochastic", lr=lr)
    moved = sum(int((stochastic[n] != start[n])[big[n]].sum()) for n in start)
    assert all(torch.equal(nearest[n][big[n]], start[n][big[n]]) for n in start)
    assert moved > 0
    assert all(torch.equal(a, b) for a, b in zip(_train("stochastic", lr=lr).values(), stochastic.values()))
    one, two = _fixed_gradient_run(), run_ranks(_fixed_gradient_run, 2)[0]
    assert torch.equal(one, two)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_bf16_masters_checkpoint_round_trip(tmp_path, offload):
    """Saved masters are the bf16 values widened; an engine with bf16 masters resumes them exactly, and one with fp32
    masters resumes the same values (states in memory, or in bf16 swap files)."""
    cfg = engine_config(2, offload, 1, precision="bf16")
    cfg["bf16"]["bf16_master_weights_and_grads"] = True
    if offload == "nvme":
        (tmp_path / "swap").mkdir()
        cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(tmp_path / "swap"), buffer_count=3)
        cfg["zero_optimization"]["sub_group_size"] = 3000
    engine = zero_offload.initialize(make_model(), cfg)
    for u in range(2):
        train_step(engine, u, 0, 1)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    saved = engine.full_state_dict()
    engine.close()
    for masters in (True, False):
        cfg["bf16"]["bf16_master_weights_and_grads"] = masters
        resumed = zero_offload.initialize(make_model(), cfg)
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert all(torch.equal(v, saved[n]) for n, v in resumed.full_state_dict().items())
        assert resumed.global_step == 2
        resumed.close()


BREAKDOWN_CASES = [(1, "cpu", 1, {}), (2, "cpu", 1, {}), (2, "cpu", 3, {}), (2, "none", 3, {}),
                   (2, "cpu", 3, {"delayed_param_update": True}), (3, "cpu", 3, {}), (3, "none", 1, {}),
                   (2, "nvme", 1, {}), (3, "nvme", 3, {}), (2, "cpu", 1, {"super_offload": True}),
                   (3, "cpu", 3, {"super_offload": True, "super_offload_fraction": 0.5})]


@pytest.mark.parametrize("stage,offload,gas,extra", BREAKDOWN_CASES,
                         ids=[f"stage{c[0]}-{c[1]}-gas{c[2]}-{'-'.join(c[3]) or 'plain'}" for c in BREAKDOWN_CASES])
def test_bf16_masters_memory_breakdown_is_estimated(stage, offload, gas, extra, tmp_path):
    """``memory_breakdown()`` after a step equals `estimate_memory` to the byte: bf16 masters (2 bytes per element;
    none where the parameters in host memory are their own masters: this CPU device without offload, stage 3's
    host shards), bf16 gradient partitions under accumulation, no 16-bit staging ring."""
    cfg = engine_config(stage, offload, gas, precision="bf16")
    cfg["bf16"]["bf16_master_weights_and_grads"] = True
    cfg["zero_optimization"]["offload_optimizer"].update(extra)
    if stage == 3 and offload != "none":
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if offload == "nvme":
        cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(tmp_path), buffer_count=3)
        cfg["zero_optimization"]["sub_group_size"] = 3000
        cfg["bf16"]["bf16_optimizer_states"] = True      # both moments in bf16 files too
    engine = zero_offload.initialize(make_model(), cfg)
    try:
        for u in range(2):
            train_step(engine, u, 0, 1)
        held = engine.memory_breakdown()
    finally:
        engine.close()
    assert_estimated(held, cfg)
    if offload == "nvme":      # every state file holds 2 bytes per element (whole sub-groups of 4096-byte blocks)
        files = {k: v["bytes"] for k, v in held.items() if v["side"] == "nvme"}
        numel = sum(p.numel() for p in make_model().parameters())
        assert set(files) == {"master", "exp_avg", "exp_avg_sq"}
        assert all(2 * numel <= v < 4 * numel for v in files.values()), files
        return
    master = held["master"]["bytes"]
    assert master == (0 if (offload == "none" or (stage == 3 and not extra)) else held["master"]["numel"] * 2)
    if extra.get("super_offload"):          # the second (or undo) bank's master is bf16 too
        bank = held["speculative_state"]
        assert bank["bytes"] < 4 * bank["numel"], bank
    grads = held.get("grad_partition", {"bytes": 0, "numel": 1})
    assert grads["bytes"] <= 2 * grads["numel"], grads


BAD = [({"bf16": {"enabled": False, "bf16_master_weights_and_grads": True}}, "'bf16.enabled' = true"),
       ({"zero_optimization": {"stage": 0}}, "'zero_optimization.stage' 1, 2 or 3"),
       ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                               "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}},
        "'zero_optimization.offload_param.device' = 'nvme'"),
       ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "ratio"),
       ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "Adam/AdamW"),
       ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": False, "master_weights_rounding": "stochastic"}},
        "'bf16.master_weights_rounding' = 'stochastic' needs")]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_bf16_master_config_errors(change, message):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    for key, value in change.items():
        cfg[key] = {**cfg.get(key, {}), **value} if key == "bf16" else value
    with warnings.catch_warnings(), pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        warnings.simplefilter("ignore")
        zero_offload.initialize(make_model(), cfg)
