"""GPT-2 shapes: the preset table, parameter counts and FLOPs, without building a model.

The library's memory model (`zero_offload.estimate`) sizes presets from here; `train/model.py` builds the
modules from the same `GPTConfig`. `gpt_units` lists the parameters the way the engine groups them (the main
job's two AdamW groups, one stage-3 unit per module), so an estimate needs no model at all.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["GPTConfig", "PRESETS", "preset", "ParameterCount", "count_parameters", "flops_per_token",
           "gpt_units"]


@dataclass
class GPTConfig:
    """Shape and regularisation of a GPT-2 model.

    Raises:
        ValueError: on non-positive sizes, ``n_embd`` not divisible by ``n_head``, or dropout
            outside [0, 1).
    """

    vocab_size: int = 4096  # matches the default byte-level BPE of `train.data`
    block_size: int = 256  # context length in tokens; sizes the positional embedding
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0  # 0 for pre-training: with one pass over the data, dropout only slows learning
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2 has them (needed for the published sizes)
    activation_checkpointing: bool = False  # recompute each block's activations in backward to save memory

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


# Published GPT-2 shapes, plus `tiny` for a 2-core CPU and the 10B model of DeepSpeed's
# ZeRO-Offload tutorial (which needs activation checkpointing to fit at all).
PRESETS: dict[str, GPTConfig] = {
    # 4.2M parameters with vocab 4096, ~0.2 s per step of 8 x 128 tokens on 2 CPU cores:
    # a few hundred steps give a clear loss drop in a few minutes.
    "tiny": GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=256),
    "gpt2": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(vocab_size=50257, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "gpt2-10b": GPTConfig(
        vocab_size=50257, block_size=1024, n_layer=50, n_head=32, n_embd=4096,
        activation_checkpointing=True,
    ),
}


def preset(name: str, **overrides) -> GPTConfig:
    """The config of a named preset, with any field replaced by a keyword (e.g. ``vocab_size=``).

    Raises:
        ValueError: for an unknown preset name (the message lists the valid ones), or for an
            override that makes an invalid config.
        TypeError: for an override that is not a GPTConfig field.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


@dataclass(frozen=True)
class ParameterCount:
    """Parameter counts (numbers of scalars). ``non_embedding`` leaves out the token and position
    embeddings (Kaplan et al.'s N); the tied LM head is the token embedding, so it is never counted twice."""

    total: int
    non_embedding: int


def count_parameters(config: GPTConfig) -> ParameterCount:
    """Count the parameters of ``GPT(config)`` from the config alone, allocating nothing."""
    c, b = config.n_embd, int(config.bias)
    layer_norm = c + b * c
    attention = (c * 3 * c + b * 3 * c) + (c * c + b * c)
    mlp = (c * 4 * c + b * 4 * c) + (4 * c * c + b * c)
    per_block = 2 * layer_norm + attention + mlp
    non_embedding = config.n_layer * per_block + layer_norm  # + the final LayerNorm
    embedding = config.vocab_size * c + config.block_size * c
    return ParameterCount(total=non_embedding + embedding, non_embedding=non_embedding)


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs (forward + backward, no recomputation) per token at context ``seq_len``
    (default ``block_size``): 6 N for the matmuls, N counting the tied head once, plus attention
    scores 12 * n_layer * n_embd * seq_len (PaLM appendix B). Use it for model-FLOPs utilisation."""
    seq_len = config.block_size if seq_len is None else seq_len
    n = count_parameters(config)
    matmul_params = n.non_embedding + config.vocab_size * config.n_embd  # the head is a matmul
    return 6 * matmul_params + 12 * config.n_layer * config.n_embd * seq_len


def gpt_units(config: GPTConfig) -> list[tuple[str, int, list[int]]]:
    """``(module name, param group, [numels])`` per stage-3 unit of ``GPT(config)`` with the main job's
    param groups (group 0: matrices and the tied embedding, decayed; group 1: biases and LayerNorms), in
    the order the engine builds them: group by group, modules in ``named_modules()`` order.

    Mirrors `zero_offload.train.model.GPT` (a test checks it against the real module on the meta device).
    """
    c, bias = config.n_embd, config.bias
    matrices = [("transformer.wte", [config.vocab_size * c]), ("transformer.wpe", [config.block_size * c])]
    vectors = []
    for i in range(config.n_layer):
        h = f"transformer.h.{i}"
        ln = [c, c] if bias else [c]
        linears = [("attn.c_attn", 3 * c * c, 3 * c), ("attn.c_proj", c * c, c),
                   ("mlp.c_fc", 4 * c * c, 4 * c), ("mlp.c_proj", 4 * c * c, c)]
        vectors.append((f"{h}.ln_1", ln))
        for j, (name, weight, b) in enumerate(linears):
            matrices.append((f"{h}.{name}", [weight]))
            if bias:
                vectors.append((f"{h}.{name}", [b]))
            if j == 1:
                vectors.append((f"{h}.ln_2", ln))
    vectors.append(("transformer.ln_f", [c, c] if bias else [c]))
    return [(m, 0, n) for m, n in matrices] + [(m, 1, n) for m, n in vectors]
