"""Hugging Face GPT-2, Llama, BERT and T5 (tiny configs, random init, no download) train like AdamW, and
their consolidated checkpoints load with strict=True.

Matrix (one run each, chosen so that every model runs at stage 3 and every stage runs with and without
offload, rather than the full cross product): with export checks GPT-2 at stage 3 with optimizer and
parameters offloaded (tied lm_head), Llama at stage 2 with the optimizer offloaded, BERT at stage 1, T5 at
stage 0 (encoder-decoder, tied embeddings); against AdamW only (`MORE`) Llama/BERT/T5 at stage 3, GPT-2 and
Llama at stage 1, BERT, T5 and GPT-2 at stage 2; GPT-2 and Llama at stage 3 with a frozen base; plus GPT-2 built
under ``deepspeed.zero.Init`` with HF's weight init run under ``GatheredParameters(modifier_rank=0)``, and
``save_pretrained`` of a stage-3 model.
"""
import warnings

import pytest
import torch

import zero_offload
import zero_offload.deepspeed as deepspeed

transformers = pytest.importorskip("transformers")
from hf_models import batch, build  # noqa: E402

LR, WD, STEPS, MICRO = 1e-3, 0.01, 2, 2
MATRIX = [("gpt2", 3, "cpu", "cpu"), ("llama", 2, "cpu", "none"), ("bert", 1, "none", "none"),
          ("t5", 0, "none", "none")]


def _reference(kind):
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        opt.zero_grad()
        model(**batch(kind, step, MICRO)).loss.backward()
        opt.step()
    return model


def _config(stage, offload, offload_param):
    zc = {"stage": stage, "offload_optimizer": {"device": offload}, "stage3_param_persistence_threshold": 0}
    if stage == 3:
        zc["offload_param"] = {"device": offload_param}
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {
        "lr": LR, "weight_decay": WD}}, "zero_optimization": zc}


@pytest.mark.parametrize("kind,stage,offload,offload_param", MATRIX)
def test_hf_model_matches_adamw_and_exports_strictly(tmp_path, kind, stage, offload, offload_param):
    engine, *_ = deepspeed.initialize(model=build(kind), config=_config(stage, offload, offload_param))
    for step in range(STEPS):
        engine.backward(engine(**batch(kind, step, MICRO)).loss)
        engine.step()
    ref = _reference(kind)
    engine.save_checkpoint(tmp_path)
    sd = zero_offload.consolidate(tmp_path)
    assert list(sd) == list(ref.state_dict())               # every name, tied aliases included, in order
    for name, p in ref.state_dict().items():
        assert (sd[name].to(p.dtype) - p).abs().max().item() <= 2e-5, name
    fresh = build(kind, seed=1)
    fresh.load_state_dict(sd, strict=True)
    if stage == 3:                                          # save_pretrained of a stage-3 model
        state = engine.module_state_dict()
        engine.module.save_pretrained(tmp_path / "hf", state_dict=state)
        loaded = type(ref).from_pretrained(tmp_path / "hf")
        for name, p in ref.state_dict().items():
            assert (loaded.state_dict()[name] - p).abs().max().item() <= 2e-5, name


# Each model at stage 3 too (the stage that rewrites a model the most), and the other stages x offloads once more.
MORE = [("llama", 3, "none", "none"), ("bert", 3, "cpu", "cpu"), ("t5", 3, "cpu", "none"), ("gpt2", 1, "none", "none"),
        ("llama", 1, "cpu", "none"), ("bert", 2, "none", "none"), ("t5", 2, "cpu", "none"), ("gpt2", 2, "none", "none")]


@pytest.mark.parametrize("kind,stage,offload,offload_param", MORE)
def test_hf_model_matches_adamw_at_more_stages(kind, stage, offload, offload_param):
    engine, *_ = deepspeed.initialize(model=build(kind), config=_config(stage, offload, offload_param))
    for step in range(STEPS):
        engine.backward(engine(**batch(kind, step, MICRO)).loss)
        engine.step()
    full = engine.full_state_dict()
    for name, p in _reference(kind).named_parameters():
        assert (full[name] - p.detach()).abs().max().item() <= 2e-5, name


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_with_a_frozen_base_at_stage_3(tmp_path, kind):
    """LoRA-style fine-tuning of a Hugging Face model: everything but the attention projections frozen; the
    frozen base is sharded, untouched by the step, and exported."""
    def freeze(model):
        for n, p in model.named_parameters():
            p.requires_grad_("attn" in n)
        return model
    engine, *_ = deepspeed.initialize(model=freeze(build(kind)), config=_config(3, "cpu", "cpu"))
    assert engine.memory_breakdown()["frozen_params"]["bytes"] > 0
    for step in range(STEPS):
        engine.backward(engine(**batch(kind, step, MICRO)).loss)
        engine.step()
    ref = freeze(build(kind))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for step in range(STEPS):
        opt.zero_grad()
        ref(**batch(kind, step, MICRO)).loss.backward()
        opt.step()
    full = engine.full_state_dict()
    assert full.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        assert (full[name] - p.detach()).abs().max().item() <= 2e-5, name
    engine.save_checkpoint(tmp_path)
    sd = zero_offload.consolidate(tmp_path)
    build(kind, seed=1).load_state_dict(sd, strict=True)
    for name, p in ref.state_dict().items():
        assert (sd[name].to(p.dtype) - p).abs().max().item() <= 2e-5, name


def test_hf_model_under_zero_init_gets_hf_init_under_gathered_parameters():
    """HF's post-construction init, run again as transformers runs it under ZeRO-3 (gathered,
    modifier_rank=0), reaches the engine: every value it wrote is trained from (the init run by the
    constructor itself is kept too: bit-identity with a normal build is in test_sharded_init_parent)."""
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        model = transformers.GPT2LMHeadModel(_gpt2_config())     # HF's own init kept in the shards
    assert all(p.is_meta for p in model.parameters())
    for m in model.modules():                                 # HF marks modules done after its (no-op) init
        m.__dict__.pop("_is_hf_initialized", None)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        model.init_weights()                                  # post-construction init, gathered
        written = {n: p.detach().clone() for n, p in model.state_dict(keep_vars=True).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = deepspeed.initialize(model=model, config=_config(3, "none", "none"))
    full = engine.module_state_dict()
    for name, value in written.items():
        assert torch.equal(full[name], value), name
    assert 0.01 < full["transformer.wte.weight"].std().item() < 0.03      # HF's N(0, 0.02), not N(0, 1)


def _gpt2_config():
    return transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=2, n_head=4)
