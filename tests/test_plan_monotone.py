"""The planner never changes what is trained unless asked, and more memory never predicts a slower run.

- bf16 moments (``bf16.bf16_optimizer_states``) change what is trained, as bf16 masters do: a plan keeps them only
  where the config asks or the caller allows them (``--allow-bf16-moments``), and its reasons say which.
- More host memory or more device memory only adds configs and settings that fit; the plan takes the best
  predicted tokens/s among them, so it never predicts fewer (a property over sizes, for the seed's 10B, GPT-2 XL
  and the Llama-3-8B shape).
"""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_offload.estimate import batching, planner
from zero_offload.estimate.planner import plan

GPU_GIB = (40, 80, 141)
HOST_GIB = (128, 160, 256)


@functools.cache
def _llama_8b() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=8192)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt2-10b": lambda: ("gpt2-10b", None), "gpt2-xl": lambda: ("gpt2-xl", None),
          "llama-3-8b": lambda: (_llama_8b(), 4096)}


@functools.cache
def _tokens_per_s(name: str, gpu: int, host: int, moments: bool = False) -> float:
    """The plan's predicted tokens/s (0 where nothing fits)."""
    model, seq = MODELS[name]()
    p = plan(model, gpu_memory=f"{gpu}GiB", host_memory=f"{host}GiB", seq_len=seq, allow_bf16_moments=moments)
    return p.batch.timing.tokens_per_s if p.fits and p.batch.timing is not None else 0.0


sizes = st.tuples(st.sampled_from(GPU_GIB), st.sampled_from(HOST_GIB))


@pytest.mark.parametrize("name,moments", [("gpt2-10b", False), ("gpt2-xl", False), ("llama-3-8b", False)])
@settings(max_examples=5, deadline=None, derandomize=True)
@given(a=sizes, b=sizes)
def test_more_memory_never_predicts_fewer_tokens_per_second(name, moments, a, b):
    small, large = (min(a[0], b[0]), min(a[1], b[1])), (max(a[0], b[0]), max(a[1], b[1]))
    less, more = _tokens_per_s(name, *small, moments), _tokens_per_s(name, *large, moments)
    assert more >= less * (1 - planner.THROUGHPUT_TOLERANCE), (name, small, less, large, more)


def test_the_issues_host_sizes_are_monotone_and_a_margin_would_break_them(monkeypatch):
    """The report: 4,313 tokens/s at 128 GiB, then 4,276 at 144 GiB (a 3 % margin let a slower setting win)."""
    chain = [_tokens_per_s("gpt2-10b", 80, h, True) for h in (120, 128, 144, 160, 200)]
    assert all(b >= a for a, b in zip(chain, chain[1:])), chain
    # power: the old 3 % margins, in the planner and in the batch choice, on a box where they let a slower setting
    # win with more host memory (since the step model counts attention's FLOPs the issue's own chain no longer shows
    # it: 141 GB and 144 -> 152 GiB does, 4,477 then 4,434 tokens/s; 4,525 then 4,564 without the margins)
    exact = [plan("gpt2-10b", gpu_memory="141GB", host_memory=f"{h}GiB", allow_bf16_moments=True)
             .batch.timing.tokens_per_s for h in (144, 152)]
    monkeypatch.setattr(planner, "THROUGHPUT_TOLERANCE", 0.03)
    monkeypatch.setattr(batching, "TIE", 0.03)
    margin = [plan("gpt2-10b", gpu_memory="141GB", host_memory=f"{h}GiB", allow_bf16_moments=True)
              .batch.timing.tokens_per_s for h in (144, 152)]
    assert exact[1] >= exact[0] and margin[1] < margin[0], (exact, margin)


def test_bf16_moments_only_where_allowed_or_asked():
    default = plan("gpt2-10b", gpu_memory="80GB", host_memory="200GiB")
    assert "bf16" not in default.name and not default.config["bf16"].get("bf16_optimizer_states")
    assert "--allow-bf16-moments" in default.reasons["precision"]
    refused = next(r for r in default.rows if r.name == "stage 2 + offload opt, bf16 moments")
    assert "--allow-bf16-moments" in refused.error and refused.estimate is None
    # where fp32 moments do not fit, nothing is planned unless allowed
    tight = plan("gpt2-10b", gpu_memory="80GB", host_memory="120GiB")
    assert not tight.fits
    allowed = plan("gpt2-10b", gpu_memory="80GB", host_memory="120GiB", allow_bf16_moments=True)
    assert allowed.fits and allowed.config["bf16"]["bf16_optimizer_states"]
    assert allowed.reasons["precision"] == "bf16 moments: allowed (--allow-bf16-moments)"
    asked = plan("gpt2-10b", gpu_memory="80GB", host_memory="120GiB",
                 config={"bf16": {"enabled": True, "bf16_optimizer_states": True},
                         "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert asked.fits and asked.reasons["precision"] == "bf16 moments: the config asks for them"
    # bf16 masters and moments need both allowances
    masters_only = plan("gpt2-10b", gpu_memory="80GB", host_memory="100GiB", allow_bf16_masters=True)
    both = plan("gpt2-10b", gpu_memory="80GB", host_memory="100GiB", allow_bf16_masters=True,
                allow_bf16_moments=True)
    assert not masters_only.fits and both.fits and "bf16 masters+moments" in both.name
