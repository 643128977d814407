"""Activation checkpoints in host memory (``activation_checkpointing.cpu_checkpointing``,
zero_offload.offload.checkpoint_offload): the inputs of checkpointed layers leave the device between forward and
their recompute, whatever checkpoint function the model calls, and training is bitwise the same as without."""
import contextlib
import time

import pytest
import torch

import zero_offload
from zero_offload.offload import simulated
from zero_offload.offload.checkpoint_offload import CheckpointOffload
from zero_offload.train.model import GPT, GPTConfig

LAYERS, STEPS = 4, 3
SHAPE = GPTConfig(vocab_size=96, block_size=32, n_layer=LAYERS, n_head=2, n_embd=32, activation_checkpointing=True)


def _config(stage: int, offload: bool, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    if offload:
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True, "cpu_checkpointing_min_bytes": 0, **extra}
    return cfg


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, SHAPE.vocab_size, (2, SHAPE.block_size + 1), generator=g) for _ in range(STEPS)]


def _train(stage: int, offload: bool, model_fn=None, config_extra: dict | None = None, **extra):
    torch.manual_seed(0)
    model = model_fn() if model_fn else GPT(SHAPE)
    engine = zero_offload.initialize(model, {**_config(stage, offload, **extra), **(config_extra or {})})
    losses = []
    try:
        for batch in _batches():
            loss = engine(batch[:, :-1], batch[:, 1:])[1] if model_fn is None else engine(batch[:, :-1],
                                                                                         labels=batch[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, engine.full_state_dict(), engine.checkpoint_offload
    finally:
        engine.close()


def _bitwise(a, b):
    return a[0] == b[0] and all(torch.equal(a[1][n], b[1][n]) for n in a[1])


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_inputs_go_to_host_memory_and_training_is_bitwise_the_same(stage):
    plain = _train(stage, False)
    moved = _train(stage, True)
    assert _bitwise(plain, moved), (plain[0], moved[0])
    counts = moved[2].counts
    # every block's input but the last one (needed first in backward) went down and came back, at every step
    per_step = LAYERS - 1
    block_input = 2 * SHAPE.block_size * SHAPE.n_embd * 4
    assert counts.offloaded == per_step * STEPS and counts.bytes_down == per_step * STEPS * block_input
    assert counts.bytes_up == counts.bytes_down
    assert counts.pool_bytes == per_step * block_input       # the pinned buffers are pooled across steps
    assert plain[2] is None


def test_it_matches_plain_adamw():
    """The house's reference: AdamW on one process, the same model, data and seed, plain checkpointing."""
    losses, weights, _ = _train(2, True)
    torch.manual_seed(0)
    model = GPT(SHAPE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for batch, loss in zip(_batches(), losses):
        ref = model(batch[:, :-1], batch[:, 1:])[1]
        ref.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert abs(ref.item() - loss) <= 1e-5
    assert max((weights[n] - p.detach()).abs().max().item() for n, p in model.named_parameters()) <= 1e-5


def test_small_inputs_stay_and_the_prefetch_is_bounded():
    _, _, kept = _train(2, True, cpu_checkpointing_min_bytes=1 << 30)
    assert kept.counts.offloaded == 0 and kept.counts.kept == LAYERS * STEPS
    one = _train(2, True, cpu_checkpointing_prefetch=1)
    assert _bitwise(one, _train(2, False))


def test_the_first_inputs_can_stay_on_the_device():
    """``cpu_checkpointing_device_inputs`` K: the first K inputs of each forward stay, the rest (but the last) move;
    bitwise the same, and the memory model moves exactly what the pool holds."""
    from zero_offload.estimate import estimate_memory
    split = _train(2, True, cpu_checkpointing_device_inputs=2)
    assert _bitwise(split, _train(2, False))
    counts = split[2].counts
    assert counts.on_device == 2 * STEPS and counts.offloaded == (LAYERS - 3) * STEPS
    torch.manual_seed(0)
    est = estimate_memory(GPT(SHAPE), _config(2, True, cpu_checkpointing_device_inputs=2), 1, micro_batch=2,
                          seq_len=SHAPE.block_size, activation_checkpointing=True)
    assert est.host["checkpoint_inputs"] == counts.pool_bytes == (LAYERS - 3) * est.checkpoint_input_bytes


def _gradients(copies=None) -> list[torch.Tensor]:
    """One forward and backward of the checkpointed GPT, its checkpoint inputs offloaded through ``copies``."""
    torch.manual_seed(0)
    model = GPT(SHAPE)
    batch = _batches()[0]
    offload = CheckpointOffload(copies, min_bytes=0) if copies is not None else None
    with offload.hooks() if offload is not None else contextlib.nullcontext():
        loss = model(batch[:, :-1], batch[:, 1:])[1]
    loss.backward()
    copies is not None and copies.close()
    return [p.grad.clone() for p in model.parameters()]


class _LateCopiesDown(simulated.SimulatedCopies):
    """Each copy down lands 0.1 s late, after the copy up of its buffer: a copy up that does not wait for its copy
    down reads the buffer poisoned."""

    def to_host(self, dst, src):
        def late():
            time.sleep(0.1)
            dst.copy_(src)
        return simulated.SimulatedHandle(self.d2h.submit(late, nbytes=dst.nbytes), self.counts)


def test_simulated_streams_see_every_wait(monkeypatch):
    """Each copy lands later on a worker thread: the gradients still match; with the waits skipped they do not
    (the simulation sees a missing wait on the copies down and up). The engine's other copies are not involved."""
    plain = _gradients()
    with simulated.forced(delay_s=0.05):          # longer than the rest of the forward: copies land late
        waited = _gradients(simulated.SimulatedCopies(torch.device("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(plain, waited))
    monkeypatch.setenv(simulated.ENV, "1")
    monkeypatch.setenv(simulated.SKIP_WAITS_ENV, "1")
    monkeypatch.setattr(simulated, "MAX_DELAY_S", 0.05)   # delays of up to 3 ms sometimes land every copy in time
    skipped = _gradients(simulated.SimulatedCopies(torch.device("cpu")))
    assert not all(torch.equal(a, b) for a, b in zip(plain, skipped))
    monkeypatch.delenv(simulated.SKIP_WAITS_ENV)
    with simulated.forced(delay_s=1e-3):          # copies down later than the copies up queued behind them
        assert all(torch.equal(a, b) for a, b in zip(plain, _gradients(_LateCopiesDown(torch.device("cpu")))))
    with simulated.forced(delay_s=2e-3):                      # the engine, under simulated streams, is bitwise too
        assert _bitwise(_train(2, True), _train(2, False))


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=SHAPE.vocab_size,
                                   max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model


def test_a_hugging_face_model_with_gradient_checkpointing_needs_no_change():
    plain = _train(3, False, _hf_llama)
    moved = _train(3, True, _hf_llama)
    assert _bitwise(plain, moved)
    assert moved[2].counts.offloaded == (LAYERS - 1) * STEPS


def test_deepspeeds_checkpoint_function_and_configure(monkeypatch):
    """``deepspeed.checkpointing.checkpoint`` (reentrant) is offloaded too, and ``configure(checkpoint_in_cpu=True)``
    turns it on for the engines built after it, as DeepSpeed's global switch does."""
    import zero_offload.deepspeed as deepspeed
    from zero_offload.train import model as gpt
    monkeypatch.setattr(gpt, "checkpoint", lambda block, x, use_reentrant: deepspeed.checkpointing.checkpoint(block, x))
    plain = _train(2, False)
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    try:
        torch.manual_seed(0)
        engine = zero_offload.initialize(GPT(SHAPE), dict(_config(2, False), activation_checkpointing={
            "cpu_checkpointing_min_bytes": 0}))
        assert engine.checkpoint_offload is not None
        engine.close()
        moved = _train(2, True)
    finally:
        deepspeed.checkpointing.configure(None, checkpoint_in_cpu=False)
    assert _bitwise(plain, moved) and moved[2].counts.offloaded == (LAYERS - 1) * STEPS


def test_bad_settings_name_the_key():
    with pytest.raises(zero_offload.ConfigError, match=r"activation_checkpointing.cpu_checkpointing_min_bytes"):
        zero_offload.Config.load(_config(2, True, cpu_checkpointing_min_bytes=-1))
    with pytest.raises(zero_offload.ConfigError, match=r"activation_checkpointing.cpu_checkpointing_prefetch"):
        zero_offload.Config.load(_config(2, True, cpu_checkpointing_prefetch=0))
    with pytest.raises(zero_offload.ConfigError, match=r"activation_checkpointing.cpu_checkpointing_device_inputs"):
        zero_offload.Config.load(_config(2, True, cpu_checkpointing_device_inputs=-1))


@pytest.mark.parametrize("model_fn", [None, _hf_llama], ids=["gpt", "llama"])
def test_the_memory_model_counts_the_moved_inputs_to_the_byte(model_fn):
    """``memory_breakdown()`` shows the checkpoint inputs in host memory as their own kind; the memory model moves
    the same bytes from the device's activations to the host."""
    from zero_offload.estimate import estimate_memory
    _, _, offload = _train(2, True, model_fn)
    torch.manual_seed(0)
    model = model_fn() if model_fn else GPT(SHAPE)
    engine = zero_offload.initialize(model, _config(2, True))
    try:
        batch = _batches()[0]
        loss = engine(batch[:, :-1], batch[:, 1:])[1] if model_fn is None else \
            engine(batch[:, :-1], labels=batch[:, 1:]).loss
        engine.backward(loss)
        measured = engine.memory_breakdown()["checkpoint_inputs"]
    finally:
        engine.close()
    moved = estimate_memory(model, _config(2, True), 1, micro_batch=2, seq_len=SHAPE.block_size,
                            activation_checkpointing=True)
    kept = estimate_memory(model, _config(2, False), 1, micro_batch=2, seq_len=SHAPE.block_size,
                           activation_checkpointing=True)
    assert measured["side"] == "host" and measured["bytes"] == moved.host["checkpoint_inputs"] == \
        offload.counts.pool_bytes
    assert kept.device["activations"] - moved.device["activations"] == moved.host["checkpoint_inputs"]


def test_the_planner_keeps_recomputes_or_moves_the_block_inputs():
    """A deep, narrow GPT (128 x 1024) at sequence 2048, whose block inputs dominate its activations: on a 12 GB
    device, keeping them in host memory lets stage 2 fit with micro-batch 4 instead of stage 3 with its parameters
    offloaded; on 80 GB the plan keeps them on the device. The config it writes turns the engine's offload on."""
    from zero_offload.presets import GPTConfig as Shape
    deep = Shape(vocab_size=50257, block_size=2048, n_layer=128, n_head=16, n_embd=1024, activation_checkpointing=True)
    tight = zero_offload.plan(deep, gpu_memory="12GB", host_memory="128GiB", seq_len=2048)
    assert tight.batch.checkpointing and tight.batch.inputs_on_host and tight.name.startswith("stage 2")
    assert tight.config["activation_checkpointing"]["cpu_checkpointing"] is True
    assert "cpu_checkpointing" in tight.reasons["activation_checkpointing"]
    assert tight.batch.estimate.host["checkpoint_inputs"] == 127 * 4 * 2048 * 1024 * 2      # (L - 1) x b*s*h*d
    without = zero_offload.plan(deep, gpu_memory="12GB", host_memory="128GiB", seq_len=2048,
                                config=dict(tight.config, activation_checkpointing={"cpu_checkpointing": False}))
    assert not without.batch.inputs_on_host
    assert tight.batch.timing.tokens_per_s > 2 * without.batch.timing.tokens_per_s
    roomy = zero_offload.plan(deep, gpu_memory="80GB", host_memory="128GiB", seq_len=2048)
    assert not roomy.batch.inputs_on_host and "activation_checkpointing" not in roomy.config


def test_the_planner_splits_the_inputs_where_the_host_cannot_hold_them_all():
    """Where every block input in host memory leaves the host short and the device has room, the plan keeps the
    fewest first inputs on the device that bring the host within its capacity (``cpu_checkpointing_device_inputs``);
    with a host that holds them all it keeps none there."""
    from zero_offload.presets import GPTConfig as Shape
    deep = Shape(vocab_size=50257, block_size=2048, n_layer=128, n_head=16, n_embd=1024, activation_checkpointing=True)
    fixed = dict(micro_batch=4, gradient_accumulation=1, seq_len=2048, activation_checkpointing=True,
                 config={"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                         "activation_checkpointing": {"cpu_checkpointing": True}})
    roomy = zero_offload.plan(deep, gpu_memory="16GB", host_memory="128GiB", **fixed)
    assert "cpu_checkpointing_device_inputs" not in roomy.config["activation_checkpointing"]
    each = 4 * 2048 * 1024 * 2
    host = roomy.batch.estimate.need()["host"]
    tight = zero_offload.plan(deep, gpu_memory="16GB", host_memory=int((host - 5.5 * each) / 0.9), **fixed)
    assert tight.fits and tight.config["activation_checkpointing"]["cpu_checkpointing_device_inputs"] == 6
    assert tight.batch.estimate.host["checkpoint_inputs"] == (127 - 6) * each
    assert "the first 6 block inputs stay on the device" in tight.reasons["activation_checkpointing"]


def _hf_llama_offload():
    """transformers 5's own ``activation_checkpointing_enable(offload=True)`` (save_on_cpu around each checkpoint)."""
    model = _hf_llama()
    model.activation_checkpointing_enable(offload=True)
    return model


def test_transformers_own_offload_takes_the_engines_path():
    """Under the engine, the layers' save_on_cpu wrapper is replaced by the plain checkpoint and the engine moves
    the same inputs on its copy streams: bitwise the same training as plain checkpointing, every block input but
    the last moved each step, with no config key."""
    from zero_offload.offload.hf_checkpoint_offload import _is_hf_offload
    assert _is_hf_offload(_hf_llama_offload().model.layers[0]._gradient_checkpointing_func)
    plain = _train(3, False, _hf_llama)
    taken = _train(3, False, _hf_llama_offload,
                   config_extra={"activation_checkpointing": {"cpu_checkpointing_min_bytes": 0}})
    assert _bitwise(plain, taken)
    assert taken[2] is not None and taken[2].counts.offloaded == (LAYERS - 1) * STEPS


def _hf_llama_every_other():
    """Blocks 0 and 2 checkpointed, 1 and 3 keeping their activations (transformers' ``every_n_layers``)."""
    model = _hf_llama()
    model.activation_checkpointing_enable(every_n_layers=2)
    return model


@pytest.mark.parametrize("stage", [2, 3])
def test_whole_blocks_activations_in_host_memory_are_bitwise_the_same(stage):
    """``cpu_layers`` 2 (the second mode): blocks 0 and 1 keep every activation they save in host memory; with
    block 0 checkpointed and block 1 not, block 1's activations move whole (not recomputed) and block 0's input
    moves as a checkpoint input. Bitwise the same training as on the device, under simulated streams too; the
    breakdown shows the host bytes of each kind."""
    with simulated.forced(delay_s=1e-3):
        plain = _train(stage, False, _hf_llama_every_other)
        moved = _train(stage, False, _hf_llama_every_other, config_extra={"activation_checkpointing": {
            "cpu_layers": 2, "cpu_checkpointing_min_bytes": 0}})
    assert _bitwise(plain, moved)
    layer = moved[2].layer_counts
    assert layer.offloaded > 0 and layer.bytes_up >= layer.bytes_down > 0 and layer.pool_bytes > 0
    assert moved[2].counts.offloaded == 0          # no cpu_checkpointing: checkpoint inputs stay


def test_cpu_layers_beyond_the_blocks_names_the_key():
    with pytest.raises(ValueError, match="'activation_checkpointing.cpu_layers' = 9, but the model has 4 blocks"):
        _train(2, False, _hf_llama_every_other, config_extra={"activation_checkpointing": {"cpu_layers": 9}})


def test_the_memory_model_moves_cpu_layers_blocks_to_the_host():
    """``cpu_layers`` 2 on a Llama not checkpointed: the estimate moves 2 blocks' saved bytes (unique storages) from
    the device's activations to the host's ``layer_activations``; the engine's pool holds 0.85-1.0 of that (each
    storage moves once however many ops save it; non-contiguous views stay on the device: 0.89 measured here, 0.96
    at hidden 64 and 128 tokens)."""
    from zero_offload.estimate import estimate_memory
    from zero_offload.estimate.decoder_activations import decoder_block_bytes, decoder_shape
    section = {"cpu_layers": 2, "cpu_checkpointing_min_bytes": 0}

    def no_checkpointing():
        m = _hf_llama()
        getattr(m, "activation_checkpointing_disable", m.gradient_checkpointing_disable)()
        return m
    model = no_checkpointing()
    base = _config(2, False)
    est = estimate_memory(model, base, micro_batch=2, seq_len=SHAPE.block_size, accelerator=False)
    moved = estimate_memory(model, {**base, "activation_checkpointing": section}, micro_batch=2,
                            seq_len=SHAPE.block_size, accelerator=False)
    block = decoder_block_bytes(decoder_shape(model.config), 2 * SHAPE.block_size, 4)
    assert moved.host["layer_activations"] == 2 * block
    assert est.device["activations"] - moved.device["activations"] == 2 * block
    engine_run = _train(2, False, no_checkpointing, config_extra={"activation_checkpointing": section})
    assert 0.85 * 2 * block <= engine_run[2].layer_counts.pool_bytes <= 2 * block
