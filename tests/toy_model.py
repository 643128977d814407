"""A small transformer for numerical tests: LayerNorm, tied input/output embeddings, biases and a
bias-free linear. Query and key projections have no bias: a key bias gets an identically-zero gradient
(softmax ignores it), and Adam would turn its rounding noise into full-size steps."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, LAYERS, SEQ = 48, 32, 4, 2, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.out = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, HEADS, c // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ToyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight   # tied

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def make_model(seed: int = 0) -> ToyTransformer:
    torch.manual_seed(seed)
    return ToyTransformer()


def batch(step: int, size: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: (size, SEQ) token ids and next-token targets."""
    g = torch.Generator().manual_seed(seed + step)
    data = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]
