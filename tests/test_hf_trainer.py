"""zero_offload.hf.Trainer against plain transformers.Trainer: same seed, data and arguments, fp32, torch AdamW,
tiny GPT-2 and Llama built from configs (nothing downloaded).

Per-step losses, logged learning rates and grad norms, and final weights agree within 1e-5 at stage 0, stage 2
with the optimizer offloaded and stage 3 with optimizer and parameters offloaded; gradient accumulation 2 and
max_grad_norm 1.0 throughout; with an optimizer section (weight decay 0: DeepSpeed decays every parameter)
and without one (weight decay 0.1 on the Trainer's own groups). Also: a run resumed from its step-3 checkpoint
ends on the uninterrupted run's weights, ``save_model`` loads strictly with ``from_pretrained`` (tied weights
kept), evaluation, a shorter last accumulation, a DeepSpeed schedule section against the Trainer's linear one,
the mixin over a Trainer subclass, the "auto" filling and its errors, and 2 ranks under torchrun.
"""
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="the hf extra (accelerate) is not installed")

import hf_trainer_runs as runs  # noqa: E402
from zero_offload.config import ConfigError  # noqa: E402
from zero_offload.hf import Trainer, ZeroOffloadTrainerMixin, fill_from_training_args  # noqa: E402

TOL = 1e-5
ROOT = Path(__file__).resolve().parent.parent
_REFERENCES: dict = {}


def _reference(tmp_path_factory, kind, **overrides):
    key = (kind, tuple(sorted(overrides.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = runs.run(kind, tmp_path_factory.mktemp("ref"), **overrides)[1:]
    return _REFERENCES[key]


def _assert_same_run(ours, ref, kind):
    losses, lrs, norms, weights = ours
    ref_losses, ref_lrs, ref_norms, ref_weights = ref
    assert len(losses) == len(ref_losses) > 0
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    assert max(abs(a - b) for a, b in zip(lrs, ref_lrs)) <= 1e-12, (lrs, ref_lrs)
    assert max(abs(a - b) for a, b in zip(norms, ref_norms)) <= TOL * max(ref_norms), (norms, ref_norms)
    assert runs.max_weight_diff(ref_weights, weights) <= TOL
    assert runs.max_weight_diff(ref_weights, runs.initial_weights(kind)) > 100 * TOL   # training moved them


CASES = {   # kind, ZeRO config, reference weight decay
    "gpt2-stage0-section": ("gpt2", runs.zero_config(0), 0.0),
    "gpt2-stage2-offload-trainer-adamw": ("gpt2", runs.zero_config(2, True, optimizer_section=False), 0.1),
    "llama-stage3-offload-all-trainer-adamw": ("llama", runs.zero_config(3, True, True, optimizer_section=False),
                                               0.1),
    "llama-stage3-offload-all-section": ("llama", runs.zero_config(3, True, True), 0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_matches_plain_trainer(tmp_path, tmp_path_factory, case):
    kind, cfg, wd = CASES[case]
    trainer, *ours = runs.run(kind, tmp_path, cfg, weight_decay=wd)
    _assert_same_run(ours, _reference(tmp_path_factory, kind, weight_decay=wd), kind)
    assert trainer.engine.config.gradient_clipping == 1.0 and trainer.engine.gradient_accumulation_steps == 2
    if cfg.get("optimizer") is None:     # the Trainer's groups: no decay on biases and norm weights
        decays = sorted({g["weight_decay"] for g in trainer.engine.optimizer.param_groups})
        assert decays == [0.0, 0.1]


@pytest.mark.parametrize("stage", [2, 3])
def test_torch_compile_argument_compiles_under_the_engine(tmp_path, tmp_path_factory, stage):
    """Issue 29: ``TrainingArguments(torch_compile=True)`` compiles the model under the engine (the plain Trainer
    compiles it through accelerate), and the run matches the plain compiled Trainer's."""
    from zero_offload.runtime.compiling import compile_counts
    kw = dict(torch_compile=True, torch_compile_backend="aot_eager")
    before = compile_counts()
    trainer, *ours = runs.run("gpt2", tmp_path, runs.zero_config(stage, True, stage == 3), **kw)
    assert trainer.engine.is_compiled and compile_counts().since(before).graphs > 0
    _assert_same_run(ours, runs.run("gpt2", tmp_path_factory.mktemp("ref"), None, **kw)[1:], "gpt2")


def test_resume_at_step_3_of_6_ends_on_the_uninterrupted_weights(tmp_path, tmp_path_factory):
    cfg = runs.zero_config(3, True, True, optimizer_section=False)
    common = dict(max_steps=6, weight_decay=0.1, warmup_steps=2)
    _, *full = runs.run("gpt2", tmp_path / "a", cfg, save_strategy="steps", save_steps=3, **common)
    ckpt = tmp_path / "a" / "checkpoint-3"
    assert (ckpt / "global_step3" / "manifest.json").is_file() and (ckpt / "model.safetensors").is_file()
    _, *resumed = runs.run("gpt2", tmp_path / "b", cfg, resume=str(ckpt), **common)
    assert runs.max_weight_diff(full[3], resumed[3]) <= 1e-6
    assert max(abs(a - b) for a, b in zip(full[0], resumed[0])) <= TOL   # steps 4-6 logged after resuming
    _assert_same_run(resumed, _reference(tmp_path_factory, "gpt2", **common), "gpt2")


def test_save_model_loads_strictly_with_tied_weights(tmp_path):
    trainer, *_, weights = runs.run("gpt2", tmp_path / "run", runs.zero_config(3, True, True))
    trainer.save_model(str(tmp_path / "out"))
    assert (tmp_path / "out" / "model.safetensors").is_file()
    model, info = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.lm_head.weight is model.transformer.wte.weight
    loaded = dict(model.named_parameters())
    assert max((loaded[k].float() - w).abs().max().item() for k, w in weights.items()) == 0.0


def test_evaluation_matches_plain_trainer(tmp_path):
    evals = []
    for cfg in (None, runs.zero_config(3, True, True)):
        trainer, *_ = runs.run("gpt2", tmp_path / str(len(evals)), cfg)
        evals.append(trainer.evaluate(runs.TokenData(4, seed=1))["eval_loss"])
    assert abs(evals[0] - evals[1]) <= TOL, evals


def test_shorter_last_accumulation_matches_plain_trainer(tmp_path, tmp_path_factory):
    # 10 samples, batches of 2: 5 micro-batches an epoch with gas 2 -> accumulations of 2, 2 and 1.
    common = dict(n_samples=10, max_steps=-1, num_train_epochs=2)
    ours = runs.run("gpt2", tmp_path, runs.zero_config(2, True), **common)[1:]
    assert len(ours[0]) == 6
    _assert_same_run(ours, _reference(tmp_path_factory, "gpt2", **common), "gpt2")


def test_deepspeed_schedule_section_is_filled_and_drives_the_rates(tmp_path):
    cfg = runs.zero_config(2, True)
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto",
        "warmup_type": "linear"}}
    trainer, losses, lrs, *_ = runs.run("gpt2", tmp_path, cfg, max_steps=5, warmup_steps=2)
    params = trainer.engine.config.scheduler.params
    assert (params.total_num_steps, params.warmup_num_steps, params.warmup_max_lr) == (5, 2, runs.LR)
    # DeepSpeed 0.19.8's WarmupDecayLR: warmup_min_lr at construction, then iteration k = 0, 1, ... gives
    # k / warmup (linear) and (total - k) / (total - warmup) after; the logged rate is the one each step used.
    expected = [0.0] + [runs.LR * (k / 2 if k < 2 else (5 - k) / 3) for k in range(4)]
    assert max(abs(a - b) for a, b in zip(lrs, expected)) <= 1e-12, lrs


class _DoubledLoss(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * 2


class _ZeroDoubledLoss(ZeroOffloadTrainerMixin, _DoubledLoss):
    pass


def test_mixin_keeps_the_subclass_behaviour(tmp_path):
    out = []
    for cls, kw in ((_DoubledLoss, {}), (_ZeroDoubledLoss, {"ds_config": runs.zero_config(2, True)})):
        trainer = cls(model=runs.build("gpt2"), args=runs.training_args(tmp_path / cls.__name__),
                      train_dataset=runs.TokenData(12), **kw)
        trainer.train()
        out.append(([h["loss"] for h in trainer.state.log_history if "loss" in h], runs.weights_of(trainer)))
    assert max(abs(a - b) for a, b in zip(out[0][0], out[1][0])) <= TOL
    assert runs.max_weight_diff(out[0][1], out[1][1]) <= TOL


# -- "auto" filling and errors ------------------------------------------------------------------------------

def test_auto_values_are_filled_as_transformers_fills_them(tmp_path):
    args = runs.training_args(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=4,
                              max_grad_norm=0.5, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6,
                              weight_decay=0.05, warmup_steps=0)
    cfg = runs.zero_config(2)
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}}
    out = fill_from_training_args(cfg, args, num_training_steps=7)
    assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"], out["train_batch_size"],
            out["gradient_clipping"]) == (3, 4, 12, 0.5)
    assert out["optimizer"]["params"] == {"lr": runs.LR, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.05}
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": runs.LR, "warmup_num_steps": 1,
                                          "total_num_steps": 7}
    assert out["fp16"] == {"enabled": False} and out["bf16"] == {"enabled": False}


def test_values_that_mismatch_the_arguments_are_all_named(tmp_path):
    cfg = runs.zero_config(2)
    cfg.update(train_micro_batch_size_per_gpu=4, gradient_clipping=2.0)
    cfg["optimizer"]["params"]["lr"] = 0.5
    with pytest.raises(ConfigError) as e:
        fill_from_training_args(cfg, runs.training_args(tmp_path), num_training_steps=3)
    for text in ("train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=2",
                 "gradient_clipping=2.0 vs hf max_grad_norm=1.0", "optimizer.params.lr=0.5 vs hf learning_rate"):
        assert text in str(e.value)


def test_bad_inputs_name_what_is_wrong(tmp_path):
    model, data = runs.build("gpt2"), runs.TokenData(4)
    with pytest.raises(ConfigError, match="ds_config must be a dict or a path"):
        Trainer(model=model, args=runs.training_args(tmp_path), train_dataset=data, ds_config=42)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizers=") as e:
        Trainer(model=model, args=runs.training_args(tmp_path), train_dataset=data, optimizers=(opt, None),
                ds_config=runs.zero_config(2))
    assert "optimizer' section" in str(e.value)
    trainer = Trainer(model=model, args=runs.training_args(tmp_path, optim="adafactor"), train_dataset=data,
                      ds_config=runs.zero_config(2, optimizer_section=False))
    with pytest.raises(ConfigError, match="TrainingArguments.optim = 'adafactor'"):
        trainer.train()


# -- 2 ranks -----------------------------------------------------------------------------------------------

def test_two_ranks_under_torchrun_match_the_trainers_ddp(tmp_path):
    from dist_utils import run_torchrun
    result = run_torchrun("hf_trainer_dist.py", tmp_path / "result.json", timeout=600)
    for name, r in result["runs"].items():
        assert r["world_size"] == 2, name
        assert max(abs(a - b) for a, b in zip(r["losses"], r["reference"])) <= TOL, (name, r)
        assert r["lrs"] == r["reference_lrs"], name
        assert max(abs(a - b) for a, b in zip(r["grad_norms"], r["reference_grad_norms"])) <= TOL * 10, (name, r)
        assert r["weight_diff"] <= TOL < 100 * TOL < r["weight_change"], (name, r)
