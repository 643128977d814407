"""zero_offload.lightning.ZeroOffloadStrategy against Lightning's default single-device strategy (1 rank) and its
DDP (2 ranks under torchrun, gloo on CPU): same module, data and seed, fp32, torch AdamW with param groups
(weight decay 0.1 on matrices only) and a warm-up schedule, accumulate_grad_batches 2 with a shorter last
accumulation, gradient_clip_val 1.0. Per-step losses and final weights agree within 1e-5 at stage 0, stage 2
with the optimizer offloaded and stage 3 with optimizer and parameters offloaded; a config optimizer section;
ModelCheckpoint directories and fit(ckpt_path=...) resuming onto the uninterrupted weights; validation; errors.
"""
import os
from pathlib import Path

import pytest

L = pytest.importorskip("lightning", reason="the lightning extra is not installed")

import lightning_runs as runs  # noqa: E402
from zero_offload.config import ConfigError  # noqa: E402
from zero_offload.lightning import ZeroOffloadStrategy  # noqa: E402

TOL = 1e-5
ROOT = Path(__file__).resolve().parent.parent
_REF: dict = {}


@pytest.fixture(autouse=True)
def _leave_no_process_group():
    """Lightning's DDP-based strategies create a one-rank gloo group and set MASTER_PORT, LOCAL_RANK, ... in this
    process; later tests (the forked multi-rank ones) need neither."""
    env = dict(os.environ)
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


def _fit(strategy=None, n=10, module_kw=None, fit_kw=None, **overrides):
    module = runs.make_module(**(module_kw or {}))
    trainer = runs.trainer(strategy, **overrides)
    trainer.fit(module, runs.loader(n), **(fit_kw or {}))
    return trainer, module, runs.weights(module, strategy)


def _reference(key, **kw):
    if key not in _REF:
        _, module, w = _fit(**kw)
        _REF[key] = (module.losses, w)
    return _REF[key]


def _assert_same(losses, w, ref):
    assert len(losses) == len(ref[0]) > 0
    assert max(abs(a - b) for a, b in zip(losses, ref[0])) <= TOL, (losses, ref[0])
    assert runs.max_diff(ref[1], w) <= TOL
    assert runs.max_diff(ref[1], runs.weights(runs.make_module())) > 100 * TOL     # training moved them


@pytest.mark.parametrize("stage,offload_optimizer,offload_param", [(0, False, False), (2, True, False),
                                                                   (3, True, True)])
def test_strategy_matches_lightnings_default(stage, offload_optimizer, offload_param):
    strategy = ZeroOffloadStrategy(config=runs.config(stage, offload_optimizer, offload_param))
    trainer, module, w = _fit(strategy)
    assert trainer.global_step == strategy.engine.global_step == 3      # 5 batches, accumulation 2: 2 + 2 + 1
    assert strategy.engine.config.gradient_clipping == 1.0 and strategy.engine.gradient_accumulation_steps == 2
    _assert_same(module.losses, w, _reference("default"))


def test_a_module_compiled_in_configure_model_trains_as_under_lightnings_default():
    """Issue 29: the module compiles its network in ``configure_model``; stage 3 with both offloads under it matches
    the same compiled module on Lightning's default strategy, and it did compile."""
    from zero_offload.runtime.compiling import compile_counts
    kw = {"module_kw": {"compile_backend": "aot_eager"}}
    before = compile_counts()
    strategy = ZeroOffloadStrategy(config=runs.config(3, True, True))
    _, module, w = _fit(strategy, **kw)
    assert compile_counts().since(before).graphs > 0
    _assert_same(module.losses, w, _reference("compiled", **kw))


def test_config_optimizer_section_matches_adamw():
    cfg = {**runs.config(2, True), "optimizer": {"type": "AdamW", "params": {"lr": runs.LR, "weight_decay": 0.0}}}
    strategy = ZeroOffloadStrategy(config=cfg)
    _, module, w = _fit(strategy, module_kw={"weight_decay": 0.0, "sched": False})
    _assert_same(module.losses, w, _reference("plain", module_kw={"weight_decay": 0.0, "sched": False}))


def test_model_checkpoint_and_resume_end_on_the_uninterrupted_weights(tmp_path):
    cfg = runs.config(3, True, True)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    _, full, w_full = _fit(ZeroOffloadStrategy(config=cfg), n=8, max_epochs=2, enable_checkpointing=True,
                           callbacks=[ckpt])
    first = tmp_path / "epoch=0-step=2.ckpt"
    assert (first / "checkpoint" / "manifest.json").is_file(), sorted(os.listdir(tmp_path))
    strategy = ZeroOffloadStrategy(config=cfg)
    trainer, resumed, w = _fit(strategy, n=8, max_epochs=2, fit_kw={"ckpt_path": str(first)})
    assert trainer.global_step == strategy.engine.global_step == 4
    assert runs.max_diff(w_full, w) <= 1e-6
    assert max(abs(a - b) for a, b in zip(full.losses[4:], resumed.losses)) <= TOL
    ref_losses, ref_w = _reference("two-epochs", n=8, max_epochs=2)
    assert runs.max_diff(ref_w, w) <= TOL


def test_validation_runs_through_the_engine():
    val = runs.loader(4, seed=1)
    metrics = []
    for strategy in (None, ZeroOffloadStrategy(config=runs.config(3, True, True))):
        module = runs.make_module()
        trainer = runs.trainer(strategy)
        trainer.fit(module, runs.loader(10), val)
        metrics.append(float(trainer.callback_metrics["val_loss"]))
    assert abs(metrics[0] - metrics[1]) <= TOL, metrics


def test_bad_inputs_name_what_is_wrong():
    with pytest.raises(ConfigError, match="must be a dict or a path"):
        ZeroOffloadStrategy(config=3)
    with pytest.raises(ValueError, match="precision_plugin"):
        ZeroOffloadStrategy(config={}, precision_plugin=L.pytorch.plugins.precision.Precision())
    cfg = {**runs.config(2), "gradient_accumulation_steps": 4}
    with pytest.raises(ConfigError, match="'gradient_accumulation_steps' = 4 differs from "
                                          r"Trainer\(accumulate_grad_batches\) = 2"):
        _fit(ZeroOffloadStrategy(config=cfg))
    with pytest.raises(ConfigError, match="gradient_clip_algorithm='value'"):
        _fit(ZeroOffloadStrategy(config=runs.config(2)), gradient_clip_algorithm="value")
    with pytest.raises(ValueError, match="restores checkpoints in fit"):
        runs.trainer(ZeroOffloadStrategy(config=runs.config(2))).validate(
            runs.make_module(), runs.loader(4), ckpt_path=str(ROOT))


def test_two_ranks_under_torchrun_match_lightnings_ddp(tmp_path):
    from dist_utils import run_torchrun
    result = run_torchrun("lightning_dist.py", tmp_path / "result.json", timeout=600)
    for name, r in result["runs"].items():
        assert r["world_size"] == 2 and r["steps"] == result["reference_steps"], (name, r)
        assert max(abs(a - b) for a, b in zip(r["losses"], result["reference"])) <= TOL, (name, r)
        assert r["weight_diff"] <= TOL < 100 * TOL < result["weight_change"], (name, r)
