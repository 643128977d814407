"""TRL's trainers on zero-offload (``class ZO(ZeroOffloadTrainerMixin, SFTTrainer)``) against the same trainer
without the mixin: losses and final weights within 1e-5, fp32, TRL's defaults (gradient checkpointing on),
accumulation 2, a tiny Llama saved to a directory (nothing downloaded).

Covered: SFT (plain, packing, padding-free, completion-only loss, LoRA through peft), DPO (its reference model
built from the path, and one given), GRPO and RLOO (generation inside training, 2 completions per prompt,
``beta`` 0.1 with a reference model, a rule reward; same seed, so both sides sample the same completions) and
the reward trainer; at stage 0, stage 2 with the optimizer offloaded and stage 3 with optimizer and parameters
offloaded, on 1 rank here and on 2 under torchrun. Then each cause found behind the failures, with its power
test: the Trainer's precision dropped, accelerate's ``"auto"`` refused, stage-3 parameters read outside their
module (TRL's fused LM head), attributes hidden by the facade (walked from the libraries' sources). And
generation under stage 3: the same tokens with every unit gathered once as module by module.
"""
import contextlib
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="TRL (the test extra) is not installed")
pytest.importorskip("peft", reason="peft (the test extra) is not installed")

import trl_runs as runs  # noqa: E402
from zero_offload.config import ConfigError  # noqa: E402

TOL = 1e-5
ROOT = Path(__file__).resolve().parent.parent
STAGES = {"stage0": runs.zero_config(0), "stage2-offload": runs.zero_config(2),
          "stage3-offload-all": runs.zero_config(3)}
_REFS: dict = {}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl_models")
    return {"causal": runs.save_model_dir(d / "causal"), "reward": runs.save_model_dir(d / "reward", "reward")}


def _reference(variant, model_dirs, tmp_path_factory):
    if variant not in _REFS:
        _REFS[variant] = runs.run_variant(variant, model_dirs, tmp_path_factory.mktemp("ref"))[1:]
    return _REFS[variant]


def _moved(variant: str, weights: dict, model_dirs) -> float:
    """How far training moved the weights (LoRA: its B matrices, which start at zero)."""
    if variant == "sft-lora":
        return max(v.abs().max().item() for k, v in weights.items() if "lora_B" in k)
    kind = "reward" if variant == "reward" else "causal"
    return runs.max_weight_diff(weights, runs.initial_weights(model_dirs[kind], kind))


CASES = [(v, s) for v in runs.VARIANTS for s in STAGES
         if s == "stage3-offload-all" or v in ("sft", "dpo", "grpo", "rloo", "reward")]


@pytest.mark.parametrize("variant,stage", CASES)
def test_trainer_matches_trl_without_the_mixin(variant, stage, model_dirs, tmp_path, tmp_path_factory):
    ref_losses, ref_weights = _reference(variant, model_dirs, tmp_path_factory)
    trainer, losses, weights = runs.run_variant(variant, model_dirs, tmp_path, STAGES[stage])
    assert trainer.engine is not None and trainer.engine.world_size == 1
    assert len(losses) == len(ref_losses) == 2
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    assert runs.max_weight_diff(ref_weights, weights) <= TOL
    assert _moved(variant, weights, model_dirs) > 100 * TOL          # training moved them


def test_two_ranks_under_torchrun_match_trl_without_the_mixin(tmp_path):
    from dist_utils import run_torchrun
    result = run_torchrun("trl_dist.py", tmp_path / "result.json", timeout=900)
    assert len(result["runs"]) == 3 * len(runs.VARIANTS)
    for name, r in result["runs"].items():
        assert r["world_size"] == 2, name
        assert max(abs(a - b) for a, b in zip(r["losses"], r["reference"])) <= TOL, (name, r)
        assert r["weight_diff"] <= TOL, (name, r)


# -- the causes, each with its power test --------------------------------------------------------------------

def _sft(model_dirs, tmp_path, config, **overrides):
    return runs.run_variant("sft", model_dirs, tmp_path, config, **overrides)[0]


def test_the_trainers_bf16_becomes_the_engines_precision(model_dirs, tmp_path, monkeypatch):
    """TRL's configs default to bf16=True; with no bf16 section accelerate adds ``{"enabled": true}``."""
    trainer = _sft(model_dirs, tmp_path, runs.zero_config(2), bf16=True)
    assert trainer.engine.config.bf16.enabled
    assert {p.dtype for p in trainer.engine.module.parameters()} == {torch.bfloat16}
    # power: without accelerate's fill the engine trains in fp32
    import zero_offload.hf.trainer as hf_trainer
    monkeypatch.setattr(hf_trainer, "fill_as_accelerate", lambda config, args: config)
    trainer = _sft(model_dirs, tmp_path / "power", runs.zero_config(2), bf16=True)
    assert not trainer.engine.config.bf16.enabled


def test_accelerates_auto_keys_are_filled_from_its_environment(monkeypatch):
    from types import SimpleNamespace

    import zero_offload.hf.config_fill as fill
    args = SimpleNamespace(fp16=False, bf16=False)
    config = runs.zero_config(3)
    fill.fill_as_accelerate(config, args)
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true")
    assert fill.fill_as_accelerate(runs.zero_config(3), args)["zero_optimization"][
        "stage3_gather_16bit_weights_on_model_save"] is True
    with pytest.raises(ConfigError, match="bf16=True but the DeepSpeed config sets fp16.enabled = true"):
        fill.fill_as_accelerate({"fp16": {"enabled": True}}, SimpleNamespace(fp16=False, bf16=True))
    # power: without the fill the engine refuses accelerate's own templates
    from zero_offload.config import Config
    with pytest.raises(ConfigError, match="stage3_gather_16bit_weights_on_model_save' = 'auto'"):
        Config.from_dict({**runs.zero_config(3), "train_micro_batch_size_per_gpu": 2,
                          "gradient_accumulation_steps": 1, "gradient_clipping": 1.0})


@pytest.mark.parametrize("persistent", [False, True])
def test_a_parameter_read_outside_its_module_is_gathered_at_stage_3(model_dirs, tmp_path, monkeypatch, persistent):
    """TRL's fused LM head reads ``lm_head.weight`` without calling ``lm_head``: found while the order is
    recorded and gathered with the root module from then on (no warning about a changed order). With
    DeepSpeed's default persistence threshold the head's unit is persistent, so it is still gathered when first
    read; after the step releases every unit it is not, and the read must still be known."""
    import warnings
    config = runs.zero_config(3)
    if persistent:
        del config["zero_optimization"]["stage3_param_persistence_threshold"]     # 1e5: the head persists
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*modules ran in a different order.*")
        trainer = _sft(model_dirs, tmp_path, config, max_steps=3)
        reference = runs.run_variant("sft", model_dirs, tmp_path / "ref", max_steps=3)
    assert trainer.engine.zero.lifecycle.stray_reads.found >= 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, reference[1])) <= TOL
    # power: without the watch the head is read released, and backward fails on its empty gradient
    from zero_offload.zero.stage3.stray_reads import StrayReads
    monkeypatch.setattr(StrayReads, "enter", lambda self: None)
    with pytest.raises(RuntimeError, match="must match the size|invalid gradient"):
        _sft(model_dirs, tmp_path / "power", runs.zero_config(3))


_READ = re.compile(r"\b(?:model|unwrapped_model|model_wrapped|wrapped_model|self\.model)\.([A-Za-z_]\w*)")


def _attributes_read() -> set[str]:
    """Every ``model.X`` (and ``unwrapped_model.X``, ``self.model.X``...) that transformers' Trainer, accelerate,
    peft and TRL's trainers read, from their installed sources."""
    import accelerate
    import peft
    import transformers
    import trl
    files = [Path(transformers.__file__).parent / "trainer.py", Path(accelerate.__file__).parent / "accelerator.py",
             Path(peft.__file__).parent / "peft_model.py", Path(trl.__file__).parent / "models" / "utils.py",
             *sorted((Path(trl.__file__).parent / "trainer").glob("*_trainer.py"))]
    names = set()
    for f in files:
        names |= set(_READ.findall(f.read_text()))
    return names


def _engine_config() -> dict:
    """Stage 3 with everything offloaded, as the engine takes it outside the Trainer."""
    cfg = runs.zero_config(3)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    return {**cfg, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_the_facade_has_every_attribute_the_libraries_read(model_dirs, monkeypatch):
    import transformers as tf

    import zero_offload
    from zero_offload.hf.facades import EngineModule
    model = tf.AutoModelForCausalLM.from_pretrained(model_dirs["causal"])
    engine = zero_offload.initialize(model, _engine_config())
    facade = EngineModule(engine)
    names = _attributes_read()
    assert len(names) > 50 and "is_gradient_checkpointing" in names and "generation_config" in names
    missing = [n for n in sorted(names) if hasattr(model, n) and not hasattr(facade, n)]
    assert missing == []
    for n in ("config", "generation_config", "is_gradient_checkpointing", "name_or_path"):
        assert getattr(facade, n) is getattr(model, n) or getattr(facade, n) == getattr(model, n), n
    facade.generation_config = model.generation_config.__class__(max_new_tokens=3)
    assert model.generation_config.max_new_tokens == 3            # a write reaches the model
    facade.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    facade.offload_states()                 # as on DeepSpeed's engine, which model_wrapped is under accelerate
    with pytest.raises(RuntimeError, match="call engine.reload_states"):
        facade(input_ids=torch.tensor([[3, 4]]))
    facade.reload_states()
    # power: a facade that hides the model (nn.Module's own lookup) misses what GRPO reads first
    monkeypatch.setattr(EngineModule, "__getattr__", torch.nn.Module.__getattr__)
    assert "is_gradient_checkpointing" in [n for n in sorted(names) if hasattr(model, n) and not hasattr(facade, n)]
    engine.close()


def test_generate_under_stage_3_gathers_once_and_gives_the_same_tokens(model_dirs):
    """The same tokens as the plain model, gathered once or module by module; the whole-model gather is what
    ``estimate_memory(..., generation=True)`` counts (``live_params`` + ``generation_params``), to the byte."""
    import transformers as tf

    import zero_offload
    from zero_offload.hf.facades import EngineModule
    plain = tf.AutoModelForCausalLM.from_pretrained(model_dirs["causal"]).eval()
    ids = torch.tensor([[5, 9, 14, 3], [7, 7, 21, 40]])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = plain.generate(ids, **kw)
    config = _engine_config()
    config["zero_optimization"].update(stage3_prefetch_bucket_size=1, stage3_max_live_parameters=1)
    engine = zero_offload.initialize(tf.AutoModelForCausalLM.from_pretrained(model_dirs["causal"]).eval(), config)
    units = len(engine.zero.units)
    before = engine.zero.lifecycle.fetch_count
    with torch.no_grad():
        once = EngineModule(engine).generate(ids, **kw)
    gathered_once = engine.zero.lifecycle.fetch_count - before
    before = engine.zero.lifecycle.fetch_count
    with torch.no_grad(), engine.gathered_for_generation(free_bytes=0) as whole:
        by_module = engine.module.generate(ids, **kw)
    assert not whole
    assert torch.equal(once, expected) and torch.equal(by_module, expected)
    assert gathered_once <= units < engine.zero.lifecycle.fetch_count - before
    estimate = zero_offload.estimate_memory(plain, config, generation=True)
    assert estimate.device["generation_params"] > 0
    assert engine.zero.lifecycle.peak_live_bytes == estimate.device["live_params"] + estimate.device["generation_params"]
    engine.close()


def test_a_subclass_overriding_a_step_the_engine_serves_fails_at_construction(model_dirs, tmp_path):
    import trl

    from zero_offload.hf import ZeroOffloadTrainerMixin

    class ClipsItself(ZeroOffloadTrainerMixin, trl.SFTTrainer):
        def _clip_grad_norm(self, model):
            return 0.0

    with pytest.raises(TypeError, match=r"ClipsItself._clip_grad_norm overrides a Trainer method"):
        ClipsItself(model=model_dirs["causal"], args=runs.trl_config("sft", tmp_path, {}),
                    train_dataset=runs.dataset("text"), ds_config=runs.zero_config(2))


@pytest.mark.parametrize("variant", ["dpo", "grpo"])
def test_the_reference_model_is_partitioned_with_no_optimizer_memory(variant, model_dirs, tmp_path, monkeypatch):
    """At stage 3 the reference model is sharded like the policy (``offload_param``: shards on the host), has no
    gradients and no optimizer state, and holds what `estimate_memory` gives a frozen model, to the byte."""
    import transformers as tf

    import zero_offload
    trainer = runs.run_variant(variant, model_dirs, tmp_path, runs.zero_config(3))[0]
    (engine,) = trainer.frozen_engines
    assert trainer.ref_model is engine.module
    assert all(p.data.numel() == 0 and p.grad is None and not p.requires_grad for p in trainer.ref_model.parameters())
    held = engine.memory_breakdown()
    assert set(held) <= {"frozen_params", "gathered", "peak_gathered"}      # no gradients, masters or moments
    with torch.device("meta"):
        skeleton = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(model_dirs["causal"]))
    skeleton.requires_grad_(False)
    estimate = zero_offload.estimate_memory(skeleton, _engine_config())
    assert held["frozen_params"]["side"] == "host"
    assert held["frozen_params"]["bytes"] == estimate.host["frozen_params"] > 0
    assert estimate.device.get("reduce_buffers", 0) == 0             # frozen units reduce nothing
    # power: prepared as accelerate prepares it, the reference model is whole on every rank
    import zero_offload.hf.trainer as hf_trainer
    monkeypatch.setattr(hf_trainer.ZeroOffloadTrainerMixin, "frozen_engine", lambda self, model: None)
    monkeypatch.setattr(hf_trainer, "sharded_from_pretrained", contextlib.nullcontext)   # TRL loads it whole
    trainer = runs.run_variant(variant, model_dirs, tmp_path / "power", runs.zero_config(3))[0]
    assert sum(p.data.numel() for p in trainer.ref_model.parameters()) > 0


def _generate_on_two_ranks(model_dir: str, roomy_rank: int):
    import torch.distributed as dist
    import transformers as tf

    import zero_offload
    config = _engine_config()
    engine = zero_offload.initialize(tf.AutoModelForCausalLM.from_pretrained(model_dir).eval(), config)
    room = (1 << 40) if dist.get_rank() == roomy_rank else 0       # one rank has no room for the whole model
    with torch.no_grad(), engine.gathered_for_generation(free_bytes=room) as whole:
        tokens = engine.module.generate(torch.tensor([[5, 9, 14, 3]]), max_new_tokens=5, do_sample=False,
                                        pad_token_id=0)
    engine.close()
    return whole, tokens.tolist()


def test_generation_gathers_the_same_way_on_every_rank(model_dirs):
    """Where one rank has no room for the whole model, every rank gathers module by module (their all-gathers
    must match), and the tokens are the plain model's."""
    import transformers as tf

    from dist_utils import run_ranks
    plain = tf.AutoModelForCausalLM.from_pretrained(model_dirs["causal"]).eval()
    expected = plain.generate(torch.tensor([[5, 9, 14, 3]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    results = run_ranks(_generate_on_two_ranks, 2, model_dirs["causal"], 0)
    assert [whole for whole, _ in results] == [False, False]
    assert all(tokens == expected.tolist() for _, tokens in results)
