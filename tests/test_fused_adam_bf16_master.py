"""The host Adam kernel with bf16 master weights (DeepSpeed's ``bf16_master_weights_and_grads``), rounded to
nearest-even or stochastically.

Nearest: bitwise the fp32 step of the widened master, rounded (what DeepSpeed's CPU Adam stores for a bf16
parameter), on every ISA this CPU has, every thread count and chunking, and in the torch fallback. Stochastic:
bitwise the same bits on every path (`stochastic_bf16` is the fallback's), across a 2**32-element boundary of the
partition; each weight lands on one of the two bf16 values around its fp32 update, the upper one with probability
equal to the distance (unbiased: tested on a million elements at 5 sigma); and an update below half a bf16 ulp,
which nearest rounding drops every time, moves the weights' mean by the update.
"""
from __future__ import annotations

import pytest
import torch

import zero_offload.optim.fused_adam as fa
from zero_offload.optim import _native, fused_adam_step
from zero_offload.optim.fused_adam import stochastic_bf16

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
NATIVE = _native.load() is not None


def _isas() -> list[str]:
    if not NATIVE:
        return []
    best = _native.set_isa(None)
    return [name for name in _native.ISA_NAMES[:_native.ISA_NAMES.index(best) + 1]]


def _inputs(n: int, state_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g).to(torch.bfloat16)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    m = (torch.randn(n, generator=g) * 0.1).to(state_dtype)
    v = (torch.rand(n, generator=g) * 0.01).to(state_dtype)
    return master, grad, m, v


def _step(master, grad, m, v, **kw):
    master, m, v = master.clone(), m.clone(), v.clone()
    fused_adam_step(master, grad, m, v, step=3, grad_scale=0.5, **HP, **kw)
    return master, m, v


def _fp32_step(master, grad, m, v):
    """The fp32 update of the widened master: what both roundings start from."""
    return _step(master.float(), grad, m, v)


def _paths():
    """Every way the kernel can run here: (ISA or None for the torch fallback, extra arguments)."""
    runs = [(isa, extra) for isa in _isas() for extra in ({"num_threads": 1}, {"num_threads": 2},
                                                          {"chunk_size": 1000, "num_threads": 2})]
    return runs + [(None, {}), (None, {"chunk_size": 1000})]


def _on(path, fn, monkeypatch):
    isa, extra = path
    if isa is None:
        monkeypatch.setenv("ZERO_OFFLOAD_NO_NATIVE", "1")
        monkeypatch.setattr(fa, "_warned", True)
        _native.load(reload=True)
        try:
            return fn(extra)
        finally:
            monkeypatch.delenv("ZERO_OFFLOAD_NO_NATIVE")
            _native.load(reload=True)
    _native.set_isa(isa)
    try:
        return fn(extra)
    finally:
        _native.set_isa(None)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_nearest_is_the_fp32_step_rounded_on_every_path(state_dtype, monkeypatch):
    n = 3 * 65_536 + 45                                   # every vector tail
    inputs = _inputs(n, state_dtype)
    wide, m_ref, v_ref = _fp32_step(*inputs)
    for path in _paths():
        master, m, v = _on(path, lambda extra: _step(*inputs, **extra), monkeypatch)
        assert master.dtype == torch.bfloat16 and torch.equal(master, wide.to(torch.bfloat16)), path
        assert torch.equal(m, m_ref) and torch.equal(v, v_ref), path


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_stochastic_bits_are_the_same_on_every_path_and_chunking(state_dtype, monkeypatch):
    n = 3 * 65_536 + 45
    inputs = _inputs(n, state_dtype)
    base = 2**32 - 70_000                                  # the partition's 2**32-th element falls inside
    wide = _fp32_step(*inputs)[0]
    want = stochastic_bf16(wide, 99, base)
    for path in _paths():
        master = _on(path, lambda extra: _step(*inputs, rounding="stochastic", seed=99, index_base=base,
                                               **extra)[0], monkeypatch)
        assert torch.equal(master, want), path
    other = _step(*inputs, rounding="stochastic", seed=100, index_base=base)[0]
    assert (other != want).float().mean() > 0.05          # the seed keys the bits


def test_stochastic_rounding_lands_on_a_neighbour_with_the_right_odds():
    """x = a + f ulp between two bf16 values rounds up with probability f: on 2**20 elements the share that
    rounds up is within 5 sigma of f, and every result is a or a + ulp (negative x alike, away from zero). Nearest
    rounding (the power check) rounds every one the same way."""
    n = 1 << 20
    for sign in (1.0, -1.0):
        a = torch.full((n,), sign * (1.0 + 2**-7 * 3))     # bf16-exact, ulp 2**-7
        for f in (0.1, 0.3, 0.7):
            x = a + sign * f * 2**-7
            rounded = stochastic_bf16(x, seed=5).float()
            up = rounded.abs() > a.abs()
            assert torch.equal(rounded[up], (a + sign * 2**-7)[up]) and torch.equal(rounded[~up], a[~up])
            sigma = (f * (1 - f) / n) ** 0.5
            assert abs(up.float().mean().item() - f) <= 5 * sigma, (sign, f)
            nearest_up = x.to(torch.bfloat16).float().abs() > a.abs()
            assert nearest_up.all() if f > 0.5 else not nearest_up.any()


def test_an_update_below_half_an_ulp_moves_the_mean_only_when_stochastic():
    """Weights at 1.0 (bf16 ulp 2**-7) under an AdamW step of about lr = 1e-3 (a tenth of an ulp): nearest leaves
    every weight where it was; stochastic moves about a tenth of them one ulp, so the mean moves by the update."""
    n = 1 << 18
    master = torch.ones(n, dtype=torch.bfloat16)
    grad = torch.ones(n, dtype=torch.bfloat16)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    near, sto = master.clone(), master.clone()
    fused_adam_step(near, grad, torch.zeros(n), torch.zeros(n), **kw)
    fused_adam_step(sto, grad, torch.zeros(n), torch.zeros(n), rounding="stochastic", seed=1, **kw)
    assert torch.equal(near, master)
    moved = (1.0 - sto.float()).mean().item()              # the fp32 update is 1e-3 (Adam's first step: lr)
    p = 1e-3 / 2**-7
    assert abs(moved - 1e-3) <= 5 * 2**-7 * (p * (1 - p) / n) ** 0.5, moved


def test_bad_arguments_are_named():
    master, grad, m, v = _inputs(16, torch.float32)
    with pytest.raises(ValueError, match="rounding must be one of"):
        fused_adam_step(master, grad, m, v, step=1, rounding="up", **HP)
    with pytest.raises(ValueError, match="bf16 master is the 16-bit weight"):
        fused_adam_step(master, grad, m, v, step=1, out=torch.empty(16, dtype=torch.bfloat16), **HP)
    with pytest.raises(ValueError, match="master"):
        fused_adam_step(master.half(), grad, m, v, step=1, **HP)
