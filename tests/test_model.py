"""The GPT-2 model of the training job: shapes, tying, init, checkpointing, sizes, sampling."""

import math

import pytest
import torch

from zero_offload.train.model import (
    GPT,
    PRESETS,
    GPTConfig,
    count_parameters,
    flops_per_token,
    preset,
)

SMALL = GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32)

# Published GPT-2 sizes (vocab 50257, context 1024, tied head), e.g. HF's model cards / nanoGPT.
PUBLISHED_SIZES = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}


def make_model(config=SMALL, seed=0):
    torch.manual_seed(seed)
    return GPT(config)


def test_forward_shapes_and_loss_near_uniform_at_init():
    model = make_model()
    idx = torch.randint(0, SMALL.vocab_size, (3, 20))
    # Targets independent of the inputs: with a tied head the untrained model already leans
    # towards repeating its input token, so targets == idx would score below ln(vocab).
    targets = torch.randint(0, SMALL.vocab_size, (3, 20))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 20, SMALL.vocab_size)
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    # Small init => near-uniform predictions => loss close to ln(vocab).
    assert abs(loss.item() - math.log(SMALL.vocab_size)) < 0.2
    logits, loss = model(idx)
    assert loss is None


def test_ignore_index_and_too_long_input():
    model = make_model()
    idx = torch.randint(0, SMALL.vocab_size, (2, 8))
    targets = idx.clone()
    targets[:, :4] = -1
    _, loss = model(idx, targets)
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="context length 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_head_is_tied_to_token_embedding():
    model = make_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert sum("wte" in n or "lm_head" in n for n in names) == 1


def test_residual_projections_have_scaled_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=4, n_embd=256))
    proj_std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    fc_std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert fc_std == pytest.approx(0.02, rel=0.05)
    assert proj_std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert torch.all(model.transformer.h[0].attn.c_attn.bias == 0)


def test_activation_checkpointing_gives_same_gradients():
    config = GPTConfig(vocab_size=97, block_size=32, n_layer=3, n_head=2, n_embd=32, dropout=0.1)
    plain = make_model(config)
    ckpt_config = GPTConfig(**{**config.__dict__, "activation_checkpointing": True})
    ckpt = make_model(ckpt_config)
    ckpt.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 97, (2, 24))
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(123)  # same dropout masks: checkpoint replays the RNG state
        _, loss = model(idx, idx)
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_published_preset_sizes_from_config_alone():
    for name, size in PUBLISHED_SIZES.items():
        assert count_parameters(preset(name)).total == size, name


def test_gpt2_10b_preset():
    config = preset("gpt2-10b")
    assert (config.n_layer, config.n_head, config.n_embd, config.block_size) == (50, 32, 4096, 1024)
    assert config.activation_checkpointing
    assert 10.0e9 < count_parameters(config).total < 10.5e9


@pytest.mark.parametrize("name", ["tiny", "gpt2"])
def test_config_count_matches_module_on_meta_device(name):
    config = preset(name)
    with torch.device("meta"):
        model = GPT(config)
    counts = count_parameters(config)
    assert model.num_parameters() == counts.total
    assert model.num_parameters(non_embedding=True) == counts.non_embedding
    assert counts.total - counts.non_embedding == (config.vocab_size + config.block_size) * config.n_embd


def test_count_without_bias():
    config = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False)
    assert make_model(config).num_parameters() == count_parameters(config).total


def test_preset_overrides_and_errors():
    config = preset("tiny", vocab_size=300, dropout=0.1)
    assert config.vocab_size == 300 and config.dropout == 0.1
    assert PRESETS["tiny"].vocab_size == 4096  # the preset table is not mutated
    with pytest.raises(ValueError, match=r"'gpt3'.*tiny.*gpt2-xl.*gpt2-10b"):
        preset("gpt3")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=100, n_head=3)


def test_flops_per_token_is_about_six_n():
    config = preset("gpt2")
    n = count_parameters(config).total
    assert 6 * n < flops_per_token(config) < 7.5 * n


def test_generate_shapes_and_greedy():
    model = make_model().eval()
    prompt = torch.randint(0, SMALL.vocab_size, (2, 5))
    out = model.generate(prompt, max_new_tokens=40, temperature=0.9, top_k=5)  # crosses block_size
    assert out.shape == (2, 45) and out.dtype == torch.long
    assert torch.equal(out[:, :5], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < SMALL.vocab_size
    greedy = model.generate(prompt, 6, temperature=0.0)
    top1 = model.generate(prompt, 6, temperature=1.0, top_k=1)
    assert torch.equal(greedy, top1)
    with pytest.raises(ValueError):
        model.generate(prompt, 1, top_k=0)


def test_optimizer_groups_cover_each_parameter_once():
    model = make_model()
    groups = model.optimizer_groups(0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert all(p.dim() < 2 for p in groups[1]["params"]) and groups[1]["weight_decay"] == 0.0
