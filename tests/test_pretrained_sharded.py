"""A Hugging Face checkpoint loaded a shard per rank (`zero_offload.hf.sharded_from_pretrained`) against a plain
``from_pretrained`` of the same files, then partitioned.

Tiny GPT-2 (tied embedding, a checkpoint cut into several safetensors files with an index), Llama (rotary
buffers) and T5 (``_keep_in_fp32_modules``: ``wo`` stays fp32 when the rest loads fp16), on 1 and 2 gloo ranks:
each rank's slice of every parameter is bitwise the plain model's values at the same flattened offsets, in the
same dtype, and after `zero_offload.initialize` at stage 3 the gathered weights are bitwise the plain model's.
Missing, unexpected and mismatched keys are transformers' own report (the same ``output_loading_info``, the same
error); a missing key is initialised as transformers does, rank 0's values kept. Peak host memory per rank on 2
ranks: `test_peak_host_memory_per_rank_is_a_half_plus_one_tensor`.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="the hf extra (accelerate) is not installed")

import hf_models  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from memory_probe import run_fresh_ranks  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import zero_offload  # noqa: E402
from zero_offload.compat.export import gathered_state_dict  # noqa: E402
from zero_offload.hf import sharded_from_pretrained  # noqa: E402
from zero_offload.zero.stage3 import registry  # noqa: E402
from zero_offload.zero.stage3.sharded_init import slice_bounds  # noqa: E402

STAGE3 = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
LOADS = [("gpt2", None), ("llama", torch.bfloat16), ("t5", torch.float16), ("mixtral", None)]


def _mixtral():
    """Experts saved one tensor each, loaded stacked (transformers' ``WeightConverter``)."""
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=hf_models.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    paths = {}
    for kind in ("gpt2", "llama", "t5", "mixtral"):
        paths[kind] = str(root / kind)
        model = _mixtral() if kind == "mixtral" else hf_models.build(kind)
        model.save_pretrained(paths[kind], max_shard_size="16KB" if kind == "gpt2" else "1GB")
    assert sum(f.endswith(".safetensors") for f in os.listdir(paths["gpt2"])) > 1     # an index and shards
    return paths


def _load(path, dtype, sharded: bool, cls=None, **kwargs):
    cls = cls or transformers.AutoModelForSeq2SeqLM if "t5" in path else cls or transformers.AutoModelForCausalLM
    with sharded_from_pretrained() if sharded else torch.no_grad():
        return cls.from_pretrained(path, dtype=dtype, **kwargs)


def _slice_mismatches(ours, plain, rank, world) -> list[str]:
    """Names whose slice is not bitwise the plain parameter's values at its flattened offsets (dtype too)."""
    bad = []
    plain_params = dict(plain.named_parameters(remove_duplicate=False))
    for name, p in ours.named_parameters(remove_duplicate=False):
        if registry.slice_of(p) is None:
            bad.append(name)
            continue
        piece, r, w = registry.slice_of(p)
        ref = plain_params[name].detach().reshape(-1)
        lo, hi = slice_bounds(ref.numel(), rank, world)
        if (r, w) != (rank, world) or piece.dtype != ref.dtype or not p.is_meta or \
                not torch.equal(piece[:hi - lo], ref[lo:hi]) or piece[hi - lo:].any():
            bad.append(name)
    return bad


def _gathered_mismatches(ours, plain) -> list[str]:
    engine = zero_offload.initialize(ours, STAGE3)     # fp32: every loaded dtype widens exactly
    got, want = gathered_state_dict(engine), plain.state_dict()
    return sorted(k for k in want if k not in got or not torch.equal(got[k], want[k].to(got[k].dtype)))


def _compare_all(paths: dict, reward_path: str) -> dict:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out = {}
    for kind, dtype in LOADS:
        plain = _load(paths[kind], dtype, sharded=False)
        ours = _load(paths[kind], dtype, sharded=True)
        out[kind] = {"slices": _slice_mismatches(ours, plain, rank, world),
                     "tied": ours.get_output_embeddings().weight is ours.get_input_embeddings().weight,
                     "plain_tied": plain.get_output_embeddings().weight is plain.get_input_embeddings().weight,
                     "dtypes": sorted({str(p.dtype) for p in ours.parameters()}),
                     "plain_dtypes": sorted({str(p.dtype) for p in plain.parameters()}),
                     "gathered": _gathered_mismatches(ours, plain)}
    # A missing key (a reward model's score head over a causal LM checkpoint): transformers initialises it;
    # every rank must end with rank 0's values, whatever its own random state.
    torch.manual_seed(0)
    plain, plain_info = _load(reward_path, None, False, transformers.AutoModelForSequenceClassification,
                              num_labels=1, output_loading_info=True)
    torch.manual_seed(rank)
    ours, info = _load(reward_path, None, True, transformers.AutoModelForSequenceClassification, num_labels=1,
                       output_loading_info=True)
    out["reward"] = {"info": _keys(info), "plain_info": _keys(plain_info),
                     "slices": _slice_mismatches(ours, plain, rank, world),
                     "gathered": _gathered_mismatches(ours, plain)}
    return out


def _keys(info: dict) -> dict:
    return {k: sorted(map(str, v)) for k, v in info.items()}


def _check(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        for kind, dtype in LOADS:
            got = out[kind]
            assert got["slices"] == [] and got["gathered"] == [], (rank, kind, got)
            assert got["tied"] == got["plain_tied"], (rank, kind)
            assert got["dtypes"] == got["plain_dtypes"], (rank, kind, got)
        assert out["gpt2"]["tied"]                              # GPT-2's head is its embedding, one slice
        assert out["t5"]["dtypes"] == ["torch.float16", "torch.float32"]       # wo kept in fp32
        reward = out["reward"]
        assert reward["info"] == reward["plain_info"] and "score.weight" in reward["info"]["missing_keys"], reward
        assert reward["slices"] == [] and reward["gathered"] == [], (rank, reward)


@pytest.mark.parametrize("world", [1, 2])
def test_slices_and_weights_are_bitwise_a_plain_load(checkpoints, world):
    if world == 1:
        _check([_compare_all(checkpoints, checkpoints["llama"])])
    else:
        _check(run_ranks(_compare_all, 2, checkpoints, checkpoints["llama"]))


def _outcome(fn):
    try:
        model, info = fn()
    except Exception as e:             # noqa: BLE001 - the outcome compared is the error itself
        return type(e).__name__, str(e).replace("\x1b[1m", "").replace("\x1b[0m", "")
    return "loaded", _keys(info)


def test_mismatched_and_unexpected_keys_are_transformers_own(checkpoints, tmp_path):
    """A shape mismatch raises transformers' error (or, ignored, is reinitialised); an extra tensor in the file is
    reported unexpected: the same outcome as a plain ``from_pretrained``."""
    extra = tmp_path / "extra"
    extra.mkdir()
    for name in os.listdir(checkpoints["llama"]):
        (extra / name).write_bytes((open(os.path.join(checkpoints["llama"], name), "rb")).read())
    tensors = load_file(str(extra / "model.safetensors"))
    save_file({**tensors, "model.extra.weight": torch.ones(3)}, str(extra / "model.safetensors"), {"format": "pt"})
    cases = [(checkpoints["llama"], {"vocab_size": hf_models.VOCAB + 1}),
             (checkpoints["llama"], {"vocab_size": hf_models.VOCAB + 1, "ignore_mismatched_sizes": True}),
             (str(extra), {})]
    for path, kwargs in cases:
        plain = _outcome(lambda: _load(path, None, False, output_loading_info=True, **kwargs))
        ours = _outcome(lambda: _load(path, None, True, output_loading_info=True, **kwargs))
        assert ours == plain, (kwargs, ours, plain)
    assert plain[0] == "loaded" and plain[1]["unexpected_keys"] == ["model.extra.weight"]
    assert _outcome(lambda: _load(checkpoints["llama"], None, True, output_loading_info=True,
                                  vocab_size=hf_models.VOCAB + 1))[0] == "RuntimeError"


def test_what_cannot_load_a_slice_per_rank_is_refused_by_name(checkpoints, tmp_path):
    model = hf_models.build("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin is not one"):
        _load(str(tmp_path), None, True)
    with pytest.raises(ValueError, match="device_map="):
        _load(checkpoints["llama"], None, True, device_map="cpu")
    with pytest.raises(ValueError, match="state_dict="), sharded_from_pretrained():
        transformers.LlamaForCausalLM.from_pretrained(None, config=model.config, state_dict=model.state_dict())
    # The context leaves transformers as it found it, even after an error.
    assert not _load(checkpoints["llama"], None, False).lm_head.weight.is_meta


LOAD_MEMORY = r"""
import json, os, sys
import torch
import torch.distributed as dist
import transformers
import transformers.models.llama.modeling_llama
sys.path.insert(0, sys.argv[-1])
from memory_probe import peak_during, rss_total
from zero_offload.hf import sharded_from_pretrained
torch.set_num_threads(1)
dist.init_process_group("gloo")
path, box = sys.argv[1], {}
transformers.AutoConfig.from_pretrained(path)            # the config and model modules: paid before the baseline

def sharded():
    with sharded_from_pretrained():
        box["ours"] = transformers.AutoModelForCausalLM.from_pretrained(path)

ours = peak_during(sharded, rss_total)
def plain():                  # its tensors map the file: read once (as initialize will), each rank holds it all
    box["plain"] = transformers.AutoModelForCausalLM.from_pretrained(path)
    box["sum"] = sum(float(p.sum()) for p in box["plain"].parameters())

plain = peak_during(plain, rss_total)
print(json.dumps({"ours": ours, "plain": plain, "meta": all(p.is_meta for p in box["ours"].parameters())}))
dist.destroy_process_group()
"""
SLACK = 16 * 2**20


def test_peak_host_memory_per_rank_is_a_half_plus_one_tensor(tmp_path):
    """2 ranks, a 250 MB fp32 Llama-shaped checkpoint: each rank's peak resident memory (VmRSS: anonymous and the
    file pages it maps, sampled every millisecond) while ``from_pretrained`` runs inside the context is at most
    half the model + its largest tensor + 16 MiB (the fixed overhead: allocator rounding, transformers' meta model
    and report), and at most 0.6x the model; the plain ``from_pretrained`` in the same process, for contrast, grows
    by the whole model."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=16,
                                   num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in transformers.LlamaForCausalLM(cfg).named_parameters()}
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    del model
    total = 4 * sum(s.numel() for s in shapes.values())
    largest = 4 * max(s.numel() for s in shapes.values())
    ranks = run_fresh_ranks(LOAD_MEMORY, 2, str(tmp_path))
    bound = total / 2 + largest + SLACK
    mib = lambda key: ", ".join(f"{r[key] / 2**20:.1f}" for r in ranks)  # noqa: E731
    print(f"\nmodel {total / 2**20:.1f} MiB, largest tensor {largest / 2**20:.1f} MiB; peak per rank {mib('ours')} "
          f"MiB (bound {bound / 2**20:.1f}); plain from_pretrained {mib('plain')} MiB")
    for r in ranks:
        assert r["meta"], r
        assert r["ours"] <= bound and r["ours"] <= 0.6 * total, r
        assert r["plain"] >= 0.9 * total, r                  # the measurement tells a whole model apart


def test_a_trl_trainer_given_a_model_name_loads_it_a_shard_per_rank(tmp_path):
    """The Trainer's mixin enters the context around its construction at stage 3 only; a peft adapter made inside
    keeps peft's values (whole, on the host) over its sharded layer."""
    pytest.importorskip("trl", reason="TRL (the test extra) is not installed")
    from peft import LoraConfig

    import trl_runs
    path = trl_runs.save_model_dir(tmp_path / "model")

    def build(stage: int, **kwargs):
        torch.manual_seed(0)
        return trl_runs.trainer_class("sft", True)(
            model=path, args=trl_runs.trl_config("sft", tmp_path / f"out{stage}", {}),
            ds_config=trl_runs.zero_config(stage),
            train_dataset=trl_runs.dataset("text"), processing_class=transformers.AutoTokenizer.from_pretrained(path),
            **kwargs)
    model = build(3).model
    assert all(p.is_meta and registry.slice_of(p) is not None for p in model.parameters())
    assert not any(p.is_meta for p in build(2).model.parameters())              # below stage 3: loaded whole
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    adapters = {n: p for n, p in build(3, peft_config=lora).model.named_parameters() if "lora_" in n}
    plain = {n: p for n, p in build(2, peft_config=lora).model.named_parameters() if "lora_" in n}
    assert adapters.keys() == plain.keys() and adapters
    assert all(not p.is_meta and torch.equal(p, plain[n]) for n, p in adapters.items())
