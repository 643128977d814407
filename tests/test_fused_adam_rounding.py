"""The host kernel's bf16 moments on every ISA path this CPU has (portable, AVX2, AVX-512; ZERO_OFFLOAD_ISA caps
the choice): stored rounded to nearest, ties to even, bitwise torch's ``.to(torch.bfloat16)``, on inputs built
to land on rounding ties; and the same bytes from every path, special values (inf, NaN, subnormals, overflow to
inf) included. With beta1 = 0 and beta2 = 3/4 one step stores exp_avg = g and exp_avg_sq = g * g / 4 + 3 v / 4,
with one of those two terms 0: each is rounded exactly once, by the store under test.
(tests/test_fused_adam.py compares the paths on random data.)
"""
from __future__ import annotations

import pytest
import torch

from zero_offload.optim import _native, fused_adam_step

NATIVE = _native.load() is not None
pytestmark = pytest.mark.skipif(not NATIVE, reason="native kernel not built")
N_TIES = 2048
BETA2 = 0.75    # 1 - beta2 and beta2 x a bf16 value are exact in fp32


def _isas() -> list[str]:
    best = _native.set_isa(None)
    return list(_native.ISA_NAMES[: _native.ISA_NAMES.index(best) + 1])


@pytest.fixture(autouse=True)
def restore_isa():
    yield
    if NATIVE:
        _native.set_isa(None)


def _bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _finite_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 gradients, bf16 exp_avg_sq before the step). Gradients: exact bf16 halfway cases (low 16 bits 0x8000,
    with an even and an odd bf16 last bit), one below and above them, random values, subnormals and the largest
    finite value (rounds to inf); exp_avg_sq is 0 there. Then gradients of 0 over random bf16 exp_avg_sq, which
    beta2 = 3/4 turns into 10-bit products: ties of both parities (a square's ties are always even)."""
    g = torch.Generator().manual_seed(7)
    hi = torch.randint(0x0080, 0x7F00, (N_TIES,), generator=g, dtype=torch.int64) << 16   # normal bf16 values
    sign = torch.randint(0, 2, (N_TIES,), generator=g, dtype=torch.int64) << 31
    ties = [_bits_to_f32(hi | low | sign) for low in (0x8000, 0x7FFF, 0x8001)]
    special = _bits_to_f32(torch.tensor([0x00000001, 0x00008000, 0x007FFFFF, 0x00018000, 0x7F7FFFFF, 0x7F7F8000,
                                         0x80000000, 0x0, 0x3F808000, 0x3F818000]))
    grads = torch.cat([*ties, torch.randn(N_TIES, generator=g), special, -special])
    v0 = (torch.rand(4 * N_TIES, generator=g) * 8).to(torch.bfloat16)
    return (torch.cat([grads, torch.zeros(v0.numel())]),
            torch.cat([torch.zeros(grads.numel(), dtype=torch.bfloat16), v0]))


def _step(g: torch.Tensor, v0: torch.Tensor, isa: str):
    _native.set_isa(isa)
    n = g.numel()
    p = torch.linspace(-1, 1, n)
    m, v = torch.zeros(n, dtype=torch.bfloat16), v0.clone()
    out = torch.empty(n, dtype=torch.bfloat16)
    fused_adam_step(p, g, m, v, step=1, lr=1e-3, beta1=0.0, beta2=BETA2, eps=1e-8, weight_decay=0.0, out=out,
                    num_threads=1)
    return p, m, v, out


def _v_fp32(g: torch.Tensor, v0: torch.Tensor) -> torch.Tensor:
    """exp_avg_sq after the step before its store: one of the two terms is 0, so this is rounded just once."""
    return (1 - BETA2) * g * g + BETA2 * v0.float()


def _u16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_inputs_hit_ties():
    """The inputs really exercise ties-to-even: for exp_avg and exp_avg_sq, both parities of the last kept bit."""
    g, v0 = _finite_inputs()
    for x in (g, _v_fp32(g, v0)):
        low = x.view(torch.int32) & 0x1FFFF
        assert int(((low == 0x08000) & torch.isfinite(x)).sum()) > 100                 # tie, even: down
        assert int(((low == 0x18000) & torch.isfinite(x)).sum()) > 100                 # tie, odd: up


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_bf16_moments_round_to_nearest_even(isa):
    if isa not in _isas():
        pytest.skip(f"this CPU has no {isa}")
    g, v0 = _finite_inputs()
    p, m, v, out = _step(g, v0, isa)
    assert _native.set_isa(isa) == isa
    assert torch.equal(_u16(m), _u16(g.to(torch.bfloat16)))            # exp_avg = g, rounded once
    assert torch.equal(_u16(v), _u16(_v_fp32(g, v0).to(torch.bfloat16)))
    assert torch.equal(_u16(out), _u16(p.to(torch.bfloat16)))


def test_every_isa_path_stores_the_same_bytes():
    """Each path's vector body and its scalar tail (odd length) on the same input, inf and NaN included."""
    special = _bits_to_f32(torch.tensor([0x7F800000, 0xFF800000, 0x7FC00000, 0x7FA00001, 0xFFC00000]))
    g, v0 = _finite_inputs()
    g = torch.cat([special, g, special])                         # specials in the vector body and the tail
    v0 = torch.cat([v0[:5], v0, v0[-5:]])
    assert g.numel() % 16 != 0
    runs = {isa: _step(g, v0, isa) for isa in _isas()}
    base = runs["scalar"]
    for isa, got in runs.items():
        for name, a, b in zip(("master", "exp_avg", "exp_avg_sq", "out"), base, got):
            assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else _u16(a),
                               b.view(torch.int32) if b.dtype == torch.float32 else _u16(b)), (isa, name)
    m = base[1].float()
    assert torch.isnan(m[torch.isnan(g)]).all()
    assert (_u16(base[1])[torch.isnan(m)] == 0x7FC0).all()          # one quiet NaN, as c10::BFloat16 writes
