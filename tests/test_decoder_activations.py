"""The memory model's activations of a Llama-family Hugging Face decoder (issue 41, item 5) against what torch
measures: `decoder_saved_bytes` equals the bytes autograd saves (unique storages packed by
``saved_tensors_hooks``, parameters excluded) exactly, so dropping any term (the MLP's intermediates, the fp32
log-probabilities, ...) fails; `estimate_memory`'s ``activations`` (the saved bytes plus the backward's largest
transient) is held to the process heap's measured peak over forward and backward."""
import ctypes
import ctypes.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode      # the one way to see every op, backward's too

from zero_offload.estimate import estimate_memory, plan
from zero_offload.estimate.decoder_activations import decoder_saved_bytes, decoder_shape
from zero_offload.estimate.table import hf_config_shape

transformers = pytest.importorskip("transformers")

BF16 = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0}}


def _model(kind: str, dtype, checkpointing: bool, vocab: int = 512, hidden: int = 64, intermediate: int = 160,
           layers: int = 2):
    names = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
    cfg = getattr(transformers, names[kind] + "Config")(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=layers, max_position_embeddings=1024, attn_implementation="sdpa")
    model = getattr(transformers, names[kind] + "ForCausalLM")(cfg).to(dtype).train()
    if checkpointing:        # transformers 5.x's name, and the one before it
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model


def _saved(model, run, seen: dict) -> None:
    """Add to ``seen`` {storage address: a tensor on it} every storage autograd saves while ``run()`` runs, but
    parameters'. The tensor is held so that no storage is freed and its address reused while measuring."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()


def measured_saved_bytes(model, b: int, s: int, checkpointing: bool, loss_tiles: int | None = None) -> int:
    """Saved bytes of one forward with labels (the loss in ``loss_tiles`` tiles: `_tiled_loss`); with
    checkpointing, those of the forward (block inputs, head) plus one block run again on its real inputs, as
    checkpoint's recompute in backward runs it (unique storages across both: in fp32 the recompute's first norm
    saves the kept input itself)."""
    x = torch.randint(0, model.config.vocab_size, (b, s))
    layer, seen, kept = model.model.layers[-1], {}, {}
    hook = layer.register_forward_pre_hook(lambda m, a, kw: kept.update(args=a, kwargs=kw), with_kwargs=True)
    _saved(model, (lambda: _tiled_loss(model, x, loss_tiles)) if loss_tiles else lambda: model(input_ids=x, labels=x),
           seen)
    hook.remove()
    if checkpointing:
        layer.gradient_checkpointing = False          # the plain forward the recompute runs
        try:
            _saved(model, lambda: layer(kept["args"][0].detach().requires_grad_(), **kept["kwargs"]), seen)
        finally:
            layer.gradient_checkpointing = True
    return sum(t.untyped_storage().nbytes() for t in seen.values())


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_saved_bytes_equal_autograds(kind, dtype, checkpointing):
    model = _model(kind, dtype, checkpointing)
    shape = decoder_shape(model.config, checkpointing)
    for b, s in ((2, 32), (3, 48)):
        got = measured_saved_bytes(model, b, s, checkpointing)
        assert decoder_saved_bytes(shape, b, s, dtype.itemsize) == got, (kind, dtype, checkpointing, b, s)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_norms_save_their_input_and_output_only(dtype, checkpointing):
    """`tile_rms_norms`: each RMSNorm keeps its input and output (2d*T*h), not the fp32 copy, the reciprocal RMS
    and the normalised tensor; the closed form equals autograd's saved bytes exactly, and fails with the untiled
    norms' terms."""
    from zero_offload.tiling import tile_rms_norms
    model = _model("llama", dtype, checkpointing)
    assert tile_rms_norms(model, 3) == 2 * len(model.model.layers) + 1
    shape = decoder_shape(model.config, checkpointing)
    for b, s in ((2, 32), (3, 48)):
        got = measured_saved_bytes(model, b, s, checkpointing)
        assert decoder_saved_bytes(shape, b, s, dtype.itemsize, norms_tiled=True) == got, (dtype, b, s)
        assert decoder_saved_bytes(shape, b, s, dtype.itemsize) > got


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_loss_saves_no_log_probabilities(dtype, checkpointing):
    """`decoder_saved_bytes(loss_tiled=True)`: the logits and loss in tiles save what the untiled model does but
    the fp32 log-probabilities (4*T*V), exactly, once the caller's own loss code is counted (`_tiled_loss` pads the
    labels a column to shift them and divides by an int64 token count; no cross entropy's 4-byte total weight)."""
    model = _model("llama", dtype, checkpointing)
    shape = decoder_shape(model.config, checkpointing)
    for b, s in ((2, 32), (3, 48)):
        got = measured_saved_bytes(model, b, s, checkpointing, loss_tiles=4)
        predicted = decoder_saved_bytes(shape, b, s, dtype.itemsize, loss_tiled=True) + tiled_loss_caller_bytes(b)
        assert predicted == got, (dtype, b, s)


def tiled_loss_caller_bytes(b: int) -> int:
    """What `_tiled_loss`'s own code saves beyond the model's labels: a padded column of ``b`` int64 labels and
    the int64 token count it divides by, less cross entropy's 4-byte total weight, which it does not save."""
    return 8 * b + 8 - 4


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use():
    """glibc's bytes in use (``mallinfo2``: arena chunks plus mmapped ones), or None without it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2

    def used() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return used


class _HeapPeak(TorchDispatchMode):
    """The heap's largest growth over its value at entry, read after every aten op (forward and backward)."""

    def __init__(self, used):
        super().__init__()
        self.used, self.base, self.peak = used, used(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.used() - self.base)
        return out


@pytest.mark.parametrize("vocab,checkpointing", [(2048, False), (2048, True), (64, True)])
def test_activations_match_the_measured_peak(vocab, checkpointing):
    """bf16, gradients of parameters dropped as they accumulate (the engine's buckets take them at stage 2, and the
    estimate counts them there): the heap's peak over forward and backward is the activations'. Vocabulary 64
    with checkpointing: the recomputed block and its MLP's gradients outweigh the head. 5 %: the heap also holds
    autograd's graph (nodes, saved-variable records), about 130 KB here; measured within 3 %."""
    used = _heap_in_use()
    if used is None:
        pytest.skip("needs glibc's mallinfo2 to read the heap")
    torch.manual_seed(0)
    model = _model("llama", torch.bfloat16, checkpointing, vocab=vocab)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    b, s = 2, 256
    x = torch.randint(0, vocab, (b, s))

    def step():
        model(input_ids=x, labels=x).loss.backward()
    for _ in range(2):        # the first run's one-time allocations (dispatch tables, autograd's buffers) stay out
        with _HeapPeak(used) as heap:
            step()
    est = estimate_memory(model, BF16, micro_batch=b, seq_len=s, accelerator=False)
    assert est.device["activations"] == pytest.approx(heap.peak, rel=0.05), est.formulas["activations"]


def test_estimate_and_plan_read_the_model():
    """No seq_len: no activations, and the formula line says why; the model's own checkpointing is read (and
    `activation_checkpointing=` overrides it) by the estimate and by the plan; a GPT-2 from transformers is not a
    Llama-family decoder and gets none."""
    model = _model("llama", torch.bfloat16, checkpointing=False)
    without = estimate_memory(model, BF16, accelerator=False)
    assert "activations" not in without.device and "need seq_len" in without.formulas["activations"]
    plain = estimate_memory(model, BF16, micro_batch=2, seq_len=64, accelerator=False)
    forced = estimate_memory(model, BF16, micro_batch=2, seq_len=64, accelerator=False, activation_checkpointing=True)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    own = estimate_memory(model, BF16, micro_batch=2, seq_len=64, accelerator=False)
    assert forced.device["activations"] == own.device["activations"] < plain.device["activations"]
    assert own.formulas["activations"].startswith("L*b*s*h*d (block inputs)")
    chosen = plan(model, 1, gpu_memory="80GB", host_memory="64GB", seq_len=64, micro_batch=2,
                  gradient_accumulation=1)
    assert chosen.batch.checkpointing is True and chosen.batch.estimate.device["activations"] > 0
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    assert "activations" not in estimate_memory(gpt2, BF16, micro_batch=2, seq_len=64, accelerator=False).device


def test_hf_config_json_counts_the_same_activations(tmp_path):
    """``zero-offload estimate --hf-config config.json --seq-len``: the decoder's sizes read from the file give the
    activations the module gives (held to the measured peak above)."""
    model = _model("qwen2", torch.bfloat16, checkpointing=False)
    model.config.save_pretrained(tmp_path)
    shape = hf_config_shape(str(tmp_path / "config.json"))
    from_file = estimate_memory(shape, BF16, micro_batch=2, seq_len=64, accelerator=False)
    from_module = estimate_memory(model, BF16, micro_batch=2, seq_len=64, accelerator=False)
    assert from_file.device["activations"] == from_module.device["activations"] > 0


def test_a_llama_config_json_counts_every_parameter(tmp_path):
    """Llama-3-8B's config.json as benchmarks/shapes holds it (no ``hidden_act``: transformers' default SiLU, a
    gated MLP of three matrices): the parameter count is the model's own, 8,030,261,248 (with two MLP matrices
    it was 6.15B, and the host memory of its optimizer states 30 GB short); without ``tie_word_embeddings`` too."""
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "shapes" / "llama-3-8b.json"
    cfg = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("architectures", "torch_dtype")}
    assert "hidden_act" not in cfg
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    assert hf_config_shape(str(path)).n_params == sum(p.numel() for p in model.parameters()) == 8_030_261_248
    # without tie_word_embeddings: LlamaConfig's default, an untied head, as transformers builds it
    bare = tmp_path / "config.json"
    bare.write_text(json.dumps({k: v for k, v in cfg.items() if k != "tie_word_embeddings"}))
    assert hf_config_shape(str(bare)).n_params == 8_030_261_248


def _tiled_loss(model, x, tiles: int):
    from zero_offload.tiling import TiledFusedLogitsLoss
    labels = torch.nn.functional.pad(x, (0, 1), value=-100)[:, 1:]

    def loss_sum(self, h, y):
        return torch.nn.functional.cross_entropy(self.lm_head(h).float(), y, ignore_index=-100, reduction="sum")
    hidden = model.model(input_ids=x).last_hidden_state
    return TiledFusedLogitsLoss.apply(loss_sum, model, hidden, labels, None, tiles, [model.lm_head.weight],
                                      "sum") / (labels != -100).sum()


@pytest.mark.parametrize("vocab, intermediate, loss_tiles, mlp_tiles, checkpointing, norm_tiles",
                         [(8192, 160, 4, None, False, None), (8192, 160, 8, None, True, None),
                          (64, 1024, None, 4, False, None), (64, 1024, None, 8, True, None),
                          (64, 1024, None, 8, True, 8), (8192, 160, 8, 4, False, 4)])
# (tiled norms with checkpointing at 2 x 256 tokens: 4.5 % over, a fixed ~110 KB of the tiled backwards' transients
# showing where the recompute is small; at 2 x 512, measured here, within 0.2 %)
def test_tiled_compute_matches_the_measured_peak(vocab, intermediate, loss_tiles, mlp_tiles, checkpointing,
                                                 norm_tiles):
    """Sequence-tiled compute in the memory model (`SequenceTiles`): the logits and loss in tiles (a vocabulary where
    the head is the peak) and the MLPs in tiles (a wide MLP and a small vocabulary, where the MLP's backward is),
    with and without checkpointing, and with the RMSNorms tiled too (`tile_rms_norms`): the heap's peak within 3 %
    (measured within 1 %). Each fails on the untiled formula (3.0x, 5.7x, 2.9x, 2.6x the tiled estimate)."""
    from zero_offload.estimate.decoder_activations import SequenceTiles
    used = _heap_in_use()
    if used is None:
        pytest.skip("needs glibc's mallinfo2 to read the heap")
    torch.manual_seed(0)
    model = _model("llama", torch.bfloat16, checkpointing, vocab=vocab, intermediate=intermediate)
    if mlp_tiles:
        from zero_offload.tiling import tile_gated_mlps
        assert tile_gated_mlps(model, mlp_tiles) == len(model.model.layers)
    if norm_tiles:
        from zero_offload.tiling import tile_rms_norms
        tile_rms_norms(model, norm_tiles)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    b, s = 2, 512 if norm_tiles and checkpointing else 256
    x = torch.randint(0, vocab, (b, s))

    def step():
        loss = _tiled_loss(model, x, loss_tiles) if loss_tiles else model(input_ids=x, labels=x).loss
        loss.backward()
    for _ in range(2):
        with _HeapPeak(used) as heap:
            step()
    tiles = SequenceTiles(loss=loss_tiles, mlp=mlp_tiles, norms=norm_tiles)
    est = estimate_memory(model, BF16, micro_batch=b, seq_len=s, accelerator=False, tiles=tiles)
    assert est.device["activations"] == pytest.approx(heap.peak, rel=0.03), est.formulas["activations"]
