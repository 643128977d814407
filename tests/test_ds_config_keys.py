"""DeepSpeed config keys added for drop-in compatibility: file parsing, legacy forms, prescale/predivide,
amsgrad and torch.optim types, OneCycle/LRRangeTest, bf16 overflow skipping. Numbers against torch."""
import base64
import json
import math
import os
import warnings

import pytest
import torch

import zero_offload
from zero_offload import Config, ConfigError
from dist_utils import run_ranks
from reference import LR, MICRO, WD, engine_config, engine_run, reference_run
from toy_model import batch, make_model


def _warned(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(x.message) for x in w]


# -- files -------------------------------------------------------------------------------------------------
def test_file_errors_name_the_key_or_file(tmp_path):
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 4, "fp16": {"enabled": true, "enabled": false}}')
    with pytest.raises(ConfigError, match="dup.json': duplicate key 'enabled'"):
        Config.load(dup)
    nan = tmp_path / "nan.json"
    nan.write_text('{"train_batch_size": 4, "gradient_clipping": NaN}')
    with pytest.raises(ConfigError, match="'gradient_clipping': got nan; NaN and Infinity are not allowed"):
        Config.load(nan)
    inf = tmp_path / "inf.hjson"
    inf.write_text('{"train_batch_size": 4, // comment\n "fp16": {"loss_scale": Infinity},}')
    with pytest.raises(ConfigError, match="key 'loss_scale' = Infinity"):
        Config.load(inf)
    with pytest.raises(ConfigError, match="'fp16.loss_scale': got -inf"):
        Config.load({"train_batch_size": 4, "fp16": {"loss_scale": float("-inf")}})
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x00\x01\x02PK\x03\x04")
    with pytest.raises(ConfigError, match="model.bin' is a binary file"):
        Config.load(binary)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"train_batch_size": 4, "x": "\xe9"}')
    with pytest.raises(ConfigError, match="latin.json' is not UTF-8 text"):
        Config.load(latin)


def test_hjson_and_base64_load_as_in_deepspeed(tmp_path):
    text = '// comment\n{\n  train_batch_size: 8,\n  "zero_optimization": {"stage": 2,},\n}\n'
    path = tmp_path / "ds.json"
    path.write_text(text)
    assert Config.load(path).zero_optimization.stage == 2
    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 1}})
                                       .encode()).decode()
    assert Config.load(encoded).zero_optimization.stage == 1


# -- legacy forms and warnings -------------------------------------------------------------------------------
def test_legacy_forms():
    cfg, msgs = _warned(lambda: Config.load({"train_batch_size": 4, "zero_optimization": True,
                                             "allgather_size": 1000, "bfloat16": {"enabled": True}}))
    assert cfg.zero_optimization.stage == 1 and cfg.zero_optimization.allgather_bucket_size == 1000
    assert cfg.precision == "bf16" and any("deprecated form" in m for m in msgs)
    cfg, _ = _warned(lambda: Config.load({"train_batch_size": 4, "zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": False,
        "stage3_gather_fp16_weights_on_model_save": True, "prefetch_bucket_size": 77}}))
    zc = cfg.zero_optimization
    assert zc.offload_optimizer.device == "cpu" and zc.offload_param.device == "cpu"
    assert not zc.offload_optimizer.pin_memory and zc.stage3_gather_16bit_weights_on_model_save
    assert zc.stage3_prefetch_bucket_size == 77 and zc.overlap_comm     # DeepSpeed: overlap on at stage 3


def test_ignored_settings_warn_once_with_the_reason():
    cfg, msgs = _warned(lambda: Config.load({"train_batch_size": 4, "zero_optimization": {
        "stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu", "pipeline": True},
        "zenflow": {"topk_ratio": 0.1}}, "activation_checkpointing": {"partition_activations": True}}))
    assert cfg.zero_optimization.offload_param.device == "none"
    for text in ("'zero_optimization.offload_param' has no effect at stage 2",
                 "'zero_optimization.offload_optimizer.pipeline'",
                 "'zero_optimization.zenflow'", "'activation_checkpointing.partition_activations' has no effect"):
        assert sum(text in m for m in msgs) == 1, (text, msgs)
    assert sum("plain ZeRO-Offload host step runs" in m for m in msgs) == 1


# -- prescale_gradients / gradient_predivide_factor: the same average, divided elsewhere --------------------
def _averaging_runs():
    configs = [engine_config(stage, ws=2, **{}) for stage in (1, 3)]
    for c in configs:
        c["zero_optimization"].pop("offload_optimizer")
    out = []
    for extra in ({"prescale_gradients": True}, {"gradient_predivide_factor": 4.0}):
        for c in configs:
            masters, _, losses = engine_run({**c, **extra}, steps=3)
            out.append((masters, losses))
    return out


def test_prescale_and_predivide_match_adamw():
    ref, ref_losses = reference_run(ws=2, steps=3)
    for masters, losses in run_ranks(_averaging_runs, 2)[0]:
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for name, r in ref.items():
            assert (masters[name] - r).abs().max().item() <= 1e-5, name


# -- optimizers that run torch on the partition ---------------------------------------------------------------
def _torch_reference(make_opt, steps=4):
    model = make_model()
    opt = make_opt(model.parameters())
    for step in range(steps):
        x, y = batch(step, MICRO)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("optimizer,offload,make_ref", [
    ({"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "amsgrad": True}}, "cpu",
     lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD, amsgrad=True)),
    ({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": True}}, "none",
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    ({"type": "Adagrad", "params": {"lr": 0.01}}, "cpu", lambda p: torch.optim.Adagrad(p, lr=0.01)),
])
def test_torch_optimizer_on_partitions_matches_torch(optimizer, offload, make_ref, tmp_path):
    engine = zero_offload.initialize(make_model(), {
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": optimizer,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": offload}}})
    for step in range(4):
        x, y = batch(step, MICRO)
        engine.backward(engine(x, y))
        engine.step()
    ref = _torch_reference(make_ref)
    full = engine.full_state_dict()
    for name, r in ref.items():
        if name in full:
            assert (full[name] - r.detach()).abs().max().item() <= 1e-5, name
    if optimizer["params"].get("amsgrad"):    # max_exp_avg_sq has no place in the format (other optimizers
        with pytest.raises(NotImplementedError, match="checkpoints of optimizer type"):   # save:
            engine.save_checkpoint(tmp_path)            # test_torch_optimizer_checkpoint)
        assert [p.name for p in tmp_path.iterdir()] == [".lock"]     # nothing half-written is left


# -- schedules: DeepSpeed's own classes are the reference where installed ------------------------------------
def _ours(scheduler, steps, lr=1e-3):
    engine = zero_offload.initialize(make_model(), {
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": lr}},
        "scheduler": scheduler, "zero_optimization": {"stage": 1}})
    seen = [(engine.get_lr()[0], engine.optimizer.param_groups[0]["betas"])]
    for step in range(steps):
        x, y = batch(step, 2)
        engine.backward(engine(x, y))
        engine.step()
        seen.append((engine.get_lr()[0], engine.optimizer.param_groups[0]["betas"]))
    return seen


def _deepspeed_schedules():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.runtime import lr_schedules
    except Exception:   # noqa: BLE001 - not installed, or not importable here
        pytest.skip("deepspeed is not installed")
    return lr_schedules


def _theirs(cls, params, steps, lr=1e-3):
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = cls(opt, **params)
    seen = [(opt.param_groups[0]["lr"], opt.param_groups[0]["betas"])]
    for _ in range(steps):
        sched.step()
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
    return seen


ONE_CYCLE = {"cycle_first_step_size": 3, "cycle_first_stair_count": 0, "cycle_second_step_size": 2,
             "decay_step_size": 2, "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "decay_lr_rate": 0.5,
             "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.1}
RANGE = {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 5.0,
         "lr_range_test_staircase": True}


@pytest.mark.parametrize("name,params", [("OneCycle", ONE_CYCLE), ("LRRangeTest", RANGE),
                                         ("OneCycle", {**ONE_CYCLE, "cycle_first_stair_count": 2})])
def test_schedules_match_deepspeed(name, params):
    lr_schedules = _deepspeed_schedules()
    ours = _ours({"type": name, "params": params}, 9)
    theirs = _theirs(getattr(lr_schedules, name), params, 9)
    for (lr_a, b_a), (lr_b, b_b) in zip(ours, theirs):
        assert lr_a == pytest.approx(lr_b) and tuple(b_a) == pytest.approx(tuple(b_b))


def test_one_cycle_formula_without_deepspeed():
    lrs = [lr for lr, _ in _ours({"type": "OneCycle", "params": {**ONE_CYCLE, "cycle_momentum": False}}, 7)]
    # rising over 3 steps, falling over 2, then min_lr / (1 + 0.5 x interval / 2)
    expected = [1e-4, 1e-4 + 9e-4 / 3, 1e-4 + 2 * 9e-4 / 3, 1e-3, 1e-4 + 9e-4 / 2, 1e-4,
                1e-4 / (1 + 0.5 * 1 / 2), 1e-4 / (1 + 0.5 * 2 / 2)]
    assert lrs == pytest.approx(expected)


def test_warmup_lr_with_zero_steps_warns_and_clamps_as_deepspeed():
    seen, msgs = _warned(lambda: _ours({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                                       "warmup_num_steps": 0}}, 3, lr=0.01))
    assert [lr for lr, _ in seen] == pytest.approx([0.0, 0.0, 0.01, 0.01])   # max(2, n) steps; max_lr = lr
    assert any("'scheduler.params.warmup_num_steps' = 0" in m for m in msgs)


# -- bf16.check_grad_overflow ----------------------------------------------------------------------------
@pytest.mark.parametrize("check", [True, False])
def test_bf16_non_finite_gradient_skips_the_step(check):
    engine = zero_offload.initialize(make_model(), {"train_batch_size": 2, "bf16": {
        "enabled": True, "check_grad_overflow": check}, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "Adam"}})
    before = engine.full_state_dict()
    x, y = batch(0, 2)
    engine.backward(engine(x, y) * float("inf"))
    engine.step()
    after = engine.full_state_dict()
    same = all(torch.equal(before[k], after[k]) for k in before)
    assert same == check and engine.skipped_steps == int(check)
    assert math.isinf(engine.last_grad_norm) or math.isnan(engine.last_grad_norm)


def test_main_job_validates_the_config_before_any_data_work(tmp_path, capsys):
    from zero_offload.cli import main
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_batch_size": 4, "zero_optimization": {"stagee": 2}}')
    # The data path does not exist: the config error must come first, before the data is looked at.
    code = main(["train", "--out", str(tmp_path / "run"), "--config", str(bad), "--data", "/nonexistent/x"])
    err = capsys.readouterr().err
    assert code == 2 and "'zero_optimization.stagee'; did you mean 'stage'" in err and "/nonexistent" not in err
    assert not (tmp_path / "run").exists()
