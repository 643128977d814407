"""A GPT-2 language model in one readable file (after nanoGPT).

Pre-LayerNorm transformer blocks, learned positional embeddings, a language-model head tied to the
token embedding, a 4x GELU MLP and causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``. Blocks can recompute their activations in
backward (activation checkpointing) to trade compute for memory.

The model knows nothing of ZeRO, partitioning or distribution: engines attach their hooks and views
from outside. Note for engines: ``lm_head.weight`` *is* ``transformer.wte.weight`` (one Parameter,
listed once by ``parameters()``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from zero_offload.presets import (GPTConfig, PRESETS, ParameterCount, count_parameters, flops_per_token,
                                  preset)

__all__ = [
    "GPTConfig",
    "GPT",
    "ParameterCount",
    "PRESETS",
    "preset",
    "count_parameters",
    "flops_per_token",
]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal scaled dot-product attention over (B, heads, T, head_dim) tensors."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Causal self-attention; ``attend`` is the core ``(q, k, v, dropout_p) -> y`` on (B, heads, T, head_dim), which
    a wrapper may replace from outside (sequence parallelism: `zero_offload.sequence.gpt`)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attend = causal_attention
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.c_attn(x).split(channels, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(batch, seq, channels)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's own GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 language model.

    Build on ``torch.device('meta')`` to inspect a model too large to allocate; ``init_weights()``
    re-initialises after the parameters are materialised.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017), as GPT-2: one Parameter serves as embedding and head.
        self.transformer.wte.weight = self.lm_head.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 initialisation: normal(0, 0.02) weights, zero biases, unit LayerNorms, and the
        projections into the residual stream scaled by 1/sqrt(2 * n_layer) so that the residual
        variance does not grow with depth (two such projections per block)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of parameter scalars (the tied head counted once); with ``non_embedding`` the
        token and position embeddings are left out. Equals ``count_parameters(self.config)``."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.transformer.wte.weight.numel() + self.transformer.wpe.weight.numel()
        return total

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits and, given targets, the mean cross-entropy loss.

        Args:
            idx: (B, T) integer token ids, T <= block_size.
            targets: optional (B, T) integer token ids; positions equal to -1 are ignored.
            position_ids: optional (T,) positions of the tokens (default 0..T-1; a shard of a longer sequence
                passes its own), each < block_size.
        Returns:
            logits: (B, T, vocab_size) in the parameters' dtype.
            loss: scalar fp32 tensor (in nats per token), or None without targets.
        Raises:
            ValueError: if T exceeds block_size or idx is not 2-D.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, seq_len), got shape {tuple(idx.shape)}")
        seq_len = idx.size(1)
        if seq_len > self.config.block_size:
            raise ValueError(
                f"sequence length {seq_len} exceeds the context length {self.config.block_size}"
            )
        pos = position_ids if position_ids is not None else torch.arange(seq_len, dtype=torch.long,
                                                                          device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        recompute = self.config.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            # use_reentrant=False: works with inputs that do not require grad and with hooks.
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            # The loss in fp32 even under 16-bit parameters: log-softmax over a large vocab loses
            # too much precision in fp16/bf16.
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after the prompt ``idx`` (B, T0) and return the
        (B, T0 + max_new_tokens) long tensor. The context is cropped to the last block_size tokens.
        ``temperature`` 0 picks the most likely token (greedy); ``top_k`` keeps only the k most
        likely. Call ``model.eval()`` first to switch dropout off.

        Raises:
            ValueError: for a negative temperature or a top_k < 1.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_token = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Parameter groups for AdamW: decay on matrices (and the tied embedding), none on biases
        and LayerNorm weights, as nanoGPT and GPT-3 do."""
        params = list(self.parameters())  # deduplicated: the tied weight appears once
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
