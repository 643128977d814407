"""The LR schedules against a plain-Python reference of DeepSpeed 0.19.8's (tests/schedule_reference.py), with
no DeepSpeed installed: learning rates and OneCycle's (beta1, 0.99) per param group after every optimizer step,
read from the engine, equal to the reference within 1e-12 relative; and the cycled betas really reach the step.
(tests/test_ds_config_keys.py::test_schedules_match_deepspeed compares with DeepSpeed itself where installed.)"""
import random
import warnings

import pytest
import torch

import zero_offload
from schedule_reference import expected
from zero_offload.optim.lr_schedules import build_scheduler

REL = 1e-12
GROUP_LRS, GROUP_BETAS = [0.01, 0.002], [(0.9, 0.999), (0.8, 0.98)]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _engine(scheduler, model=None, stage=2, offload="cpu"):
    model = model or _model()
    groups = [{"params": [p for n, p in model.named_parameters() if n.startswith("0.")], "lr": GROUP_LRS[0],
               "betas": GROUP_BETAS[0]},
              {"params": [p for n, p in model.named_parameters() if n.startswith("2.")], "lr": GROUP_LRS[1],
               "betas": GROUP_BETAS[1]}]
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload}}}
    if scheduler is not None:
        config["scheduler"] = scheduler
    return zero_offload.initialize(model, config, model_parameters=groups)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2, 4, generator=g)


def _seen(engine):
    groups = engine.optimizer.param_groups
    return engine.get_lr(), [tuple(g["betas"]) for g in groups]


def _engine_schedule(scheduler, steps):
    """(lrs, betas) per group after 0 .. steps optimizer steps of the engine."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # warmup_num_steps = 0 and the like warn as DeepSpeed does
        engine = _engine(scheduler)
    seen = [_seen(engine)]
    for step in range(steps):
        engine.backward(engine(_batch(step)).square().mean())
        engine.step()
        seen.append(_seen(engine))
    return seen


def _assert_same(got, want, where):
    for k, ((lrs, betas), (ref_lrs, ref_betas)) in enumerate(zip(got, want, strict=True)):
        assert lrs == pytest.approx(ref_lrs, rel=REL, abs=0), (where, k, "lr")
        flat, ref_flat = [x for b in betas for x in b], [x for b in ref_betas for x in b]
        assert flat == pytest.approx(ref_flat, rel=REL, abs=0), (where, k, "betas")


# Each case covers its phases: warm-up and the plateau or decay after it; OneCycle's rising half, falling half
# (of another length), stairs in either half, and the decay of lr and beta1 after the cycle.
ONE_CYCLE = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 4, "cycle_second_step_size": 3,
             "decay_step_size": 2, "decay_lr_rate": 0.5, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
             "decay_mom_rate": 0.01}
CASES = [
    ("OneCycle", ONE_CYCLE, 12),
    ("OneCycle", {**ONE_CYCLE, "cycle_first_step_size": 6, "cycle_second_step_size": 6,
                  "cycle_first_stair_count": 2, "cycle_second_stair_count": 3}, 16),
    ("OneCycle", {**ONE_CYCLE, "cycle_first_stair_count": 3}, 10),          # second count defaults to first
    ("OneCycle", {**ONE_CYCLE, "cycle_momentum": False}, 10),               # betas stay each group's own
    ("OneCycle", {"cycle_min_lr": 2e-4, "cycle_max_lr": 4e-3, "cycle_first_step_size": 3}, 9),   # no decay
    ("OneCycle", {**ONE_CYCLE, "cycle_second_step_size": 0, "decay_step_size": 1}, 7),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 5.0},
     8),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 5.0,
                     "lr_range_test_staircase": True}, 8),
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 4}, 7),
    ("WarmupLR", {"warmup_num_steps": 3, "warmup_type": "linear"}, 6),     # warms each group to its own lr
    ("WarmupLR", {"warmup_num_steps": 0}, 4),                                # read as 2 steps, as DeepSpeed
    ("WarmupDecayLR", {"warmup_num_steps": 3, "total_num_steps": 8}, 10),   # peak 0.001; decays to 0, stays
    ("WarmupDecayLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 5e-3, "warmup_num_steps": 2,
                       "warmup_type": "linear", "total_num_steps": 6}, 8),
    ("WarmupCosineLR", {"total_num_steps": 9, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.05}, 11),
    ("WarmupCosineLR", {"total_num_steps": 7, "warmup_num_steps": 2, "warmup_type": "linear"}, 8),
]


@pytest.mark.parametrize("name,params,steps", CASES)
def test_engine_schedule_matches_the_reference(name, params, steps):
    got = _engine_schedule({"type": name, "params": params}, steps)
    _assert_same(got, expected(name, params, steps, GROUP_LRS, GROUP_BETAS), (name, params))


def _random_case(rng):
    name = rng.choice(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest", "OneCycle"])
    if name in ("WarmupLR", "WarmupDecayLR"):
        p = {"warmup_min_lr": rng.choice([0.0, 1e-5]), "warmup_num_steps": rng.randint(1, 9),
             "warmup_type": rng.choice(["log", "linear"])}
        if rng.random() < 0.7:
            p["warmup_max_lr"] = rng.choice([0.01, 3e-3])
        if name == "WarmupDecayLR":
            p["total_num_steps"] = rng.randint(1, 20)
    elif name == "WarmupCosineLR":
        p = {"total_num_steps": rng.randint(1, 20), "warmup_num_steps": rng.randint(1, 9),
             "warmup_min_ratio": rng.choice([0.0, 0.1]), "cos_min_ratio": rng.choice([0.0, 1e-4, 0.2]),
             "warmup_type": rng.choice(["log", "linear"])}
    elif name == "LRRangeTest":
        p = {"lr_range_test_min_lr": rng.choice([1e-4, 3e-3]), "lr_range_test_step_size": rng.randint(1, 7),
             "lr_range_test_step_rate": rng.choice([0.5, 1.0, 5.0]), "lr_range_test_staircase": rng.random() < 0.5}
    else:
        p = {"cycle_min_lr": rng.choice([1e-4, 3e-4]), "cycle_max_lr": rng.choice([1e-3, 0.01]),
             "cycle_first_step_size": rng.randint(1, 9), "decay_step_size": rng.choice([0, 1, 2, 5]),
             "decay_lr_rate": rng.choice([0.0, 0.5, 0.001]), "cycle_momentum": rng.random() < 0.8,
             "cycle_min_mom": rng.choice([0.8, 0.85]), "cycle_max_mom": rng.choice([0.9, 0.95]),
             "decay_mom_rate": rng.choice([0.0, 0.1, 0.01])}
        for key, lo, chance in (("cycle_second_step_size", 0, 0.6), ("cycle_first_stair_count", 0, 0.6),
                                ("cycle_second_stair_count", 0, 0.4)):
            if rng.random() < chance:
                p[key] = rng.randint(lo, 9 if key == "cycle_second_step_size" else 5)
    return name, p


def test_schedules_match_the_reference_over_random_configs():
    """The schedule classes themselves (no engine, so many configs are cheap) over 40 steps, seeded."""
    rng = random.Random(0)
    for _ in range(600):
        name, params = _random_case(rng)
        config = zero_offload.Config.load({"train_batch_size": 1, "scheduler": {"type": name, "params": params}})
        opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr, "betas": b}
                                for lr, b in zip(GROUP_LRS, GROUP_BETAS)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched = build_scheduler(config.scheduler, opt)
        seen = []
        for step in range(41):
            if step:
                sched.step()
            seen.append(([g["lr"] for g in opt.param_groups], [tuple(g["betas"]) for g in opt.param_groups]))
        _assert_same(seen, expected(name, params, 40, GROUP_LRS, GROUP_BETAS), (name, params))


def test_one_cycle_momentum_is_disabled_for_an_optimizer_without_betas():
    """DeepSpeed cycles momentum only where the optimizer has betas: SGD's groups get no betas written."""
    config = zero_offload.Config.load({"train_batch_size": 1, "scheduler": {"type": "OneCycle",
                                                                             "params": ONE_CYCLE}})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    sched = build_scheduler(config.scheduler, opt)
    for k in range(1, 10):
        sched.step()
        lrs, _ = expected("OneCycle", ONE_CYCLE, k, [0.1], [None])[-1]
        assert opt.param_groups[0]["lr"] == pytest.approx(lrs[0], rel=REL, abs=0)
        assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9


def _adamw_with_schedule(name, params, steps, betas_from_schedule=True):
    """torch.optim.AdamW on the same model and data, each step run with the reference's lr and betas."""
    model = _model()
    groups = [{"params": list(model[0].parameters()), "lr": GROUP_LRS[0], "betas": GROUP_BETAS[0]},
              {"params": list(model[2].parameters()), "lr": GROUP_LRS[1], "betas": GROUP_BETAS[1]}]
    opt = torch.optim.AdamW(groups, weight_decay=0.01)
    plan = expected(name, params, steps, GROUP_LRS, GROUP_BETAS)
    for step in range(steps):
        lrs, betas = plan[step]            # what the groups hold before this step
        for group, lr, b in zip(opt.param_groups, lrs, betas):
            group["lr"] = lr
            if betas_from_schedule:
                group["betas"] = b
        opt.zero_grad()
        model(_batch(step)).square().mean().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (1, "none")])
def test_one_cycle_betas_reach_the_optimizer_step(stage, offload):
    """fp32 training under OneCycle with cycle_momentum equals torch's AdamW stepped with the reference's lr
    and (beta1, 0.99) at every step; the same AdamW with the groups' own betas is far off, so the comparison
    would see betas that are written into the param groups but not used by the step."""
    steps = 12
    engine = _engine({"type": "OneCycle", "params": ONE_CYCLE}, stage=stage, offload=offload)
    for step in range(steps):
        engine.backward(engine(_batch(step)).square().mean())
        engine.step()
    got = engine.full_state_dict()
    want = _adamw_with_schedule("OneCycle", ONE_CYCLE, steps)
    stale = _adamw_with_schedule("OneCycle", ONE_CYCLE, steps, betas_from_schedule=False)
    for name, ref in want.items():
        assert (got[name] - ref).abs().max().item() <= 1e-6, name
    assert max((stale[n] - want[n]).abs().max().item() for n in want) > 1e-4
