"""The host Adam kernel (`fused_adam_step`, `CPUAdam`) against torch.optim.AdamW / Adam.

Bounds checked here (stated in zero_offload/optim/fused_adam.py): moments bitwise equal to torch's in
AdamW mode; weights within rtol=1e-6 plus 2**-23 * (|w| + 8 lr) per step (torch's sqrt is not correctly rounded);
every ISA path and thread count bitwise equal; ``out`` bitwise ``master.to(out.dtype)``; bf16 moments
within 0.01 * lr * steps of fp32 moments. Tests never time anything.
"""
from __future__ import annotations

import math

import pytest
import torch

import zero_offload.optim.fused_adam as fa
from zero_offload.optim import CPUAdam, _native, fused_adam_step

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NATIVE = _native.load() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="native kernel not built")


def _isas() -> list[str]:
    if not NATIVE:
        return []
    best = _native.set_isa(None)
    return list(_native.ISA_NAMES[: _native.ISA_NAMES.index(best) + 1])


@pytest.fixture
def restore_isa():
    yield
    if NATIVE:
        _native.set_isa(None)


def torch_reference(p0, grads, *, steps_kw, adamw_mode=True, grad_scale=1.0, bias_correction=True):
    """torch.optim.AdamW (or Adam with L2) on fp32 copies of ``grads`` times grad_scale."""
    p = p0.clone().requires_grad_(True)
    opt_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = opt_cls([p], lr=steps_kw["lr"], betas=(steps_kw["beta1"], steps_kw["beta2"]), eps=steps_kw["eps"],
                  weight_decay=steps_kw["weight_decay"], foreach=False)
    if not bias_correction:  # torch has no switch: AdamW's order of ops, written out
        m, v, w = torch.zeros_like(p0), torch.zeros_like(p0), p0.clone()
        for g in grads:
            g = g.float() * grad_scale if grad_scale != 1.0 else g.float()
            wd, lr = steps_kw["weight_decay"], steps_kw["lr"]
            if adamw_mode:
                w.mul_(1 - lr * wd)
            else:
                g = g.add(w, alpha=wd)
            m.lerp_(g, 1 - steps_kw["beta1"])
            v.mul_(steps_kw["beta2"]).addcmul_(g, g, value=1 - steps_kw["beta2"])
            w.addcdiv_(m, v.sqrt().add_(steps_kw["eps"]), value=-lr)
        return w, m, v
    for g in grads:
        p.grad = g.float() * grad_scale if grad_scale != 1.0 else g.float()
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def run_ours(p0, grads, *, steps_kw, out_dtype=None, state_dtype=torch.float32, **kw):
    p = p0.clone()
    m = torch.zeros(p0.numel(), dtype=state_dtype)
    v = torch.zeros(p0.numel(), dtype=state_dtype)
    out = None if out_dtype is None else torch.empty(p0.numel(), dtype=out_dtype)
    for step, g in enumerate(grads, 1):
        fused_adam_step(p, g, m, v, step=step, out=out, **steps_kw, **kw)
    return p, m, v, out


def assert_weights_close(ours, ref, steps, lr=HP["lr"]):
    """rtol=1e-6 (8 ulps), plus per step one ulp of |w| and 2**-20 * lr (torch's sqrt is within 1 ulp,
    ours correctly rounded; Adam's update is at most (1-beta1)/sqrt(1-beta2) * lr ~ 3.2 lr here)."""
    tol = 1e-6 * ref.abs() + steps * 2.0**-23 * (ref.abs() + 8 * lr)
    bad = (ours - ref).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} weights off; max diff {(ours - ref).abs().max().item():.3e}"


@pytest.mark.parametrize("n", [0, 1, 7, 33, 1001, 65_537])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_torch(n, grad_dtype, adamw_mode, weight_decay, bias_correction):
    g = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(grad_dtype) for _ in range(4)]
    kw = dict(HP, weight_decay=weight_decay)
    p, m, v, _ = run_ours(p0, grads, steps_kw=kw, adamw_mode=adamw_mode, bias_correction=bias_correction)
    rp, rm, rv = torch_reference(p0, grads, steps_kw=kw, adamw_mode=adamw_mode, bias_correction=bias_correction)
    assert_weights_close(p, rp, len(grads))
    if adamw_mode or weight_decay == 0.0:  # moments do not depend on the weights: same bits as torch
        assert torch.equal(m, rm) and torch.equal(v, rv)
    else:
        torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("grad_scale", [0.5, 1.0 / 1024, 3.0])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_grad_scale(grad_scale, grad_dtype):
    p0 = torch.randn(4099)
    grads = [(torch.randn(4099) / grad_scale).to(grad_dtype) for _ in range(3)]
    kw = dict(HP, weight_decay=0.01)
    p, m, v, _ = run_ours(p0, grads, steps_kw=kw, grad_scale=grad_scale)
    rp, rm, rv = torch_reference(p0, grads, steps_kw=kw, grad_scale=grad_scale)
    assert_weights_close(p, rp, 3)
    assert torch.equal(m, rm) and torch.equal(v, rv)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_out_is_master_rounded(out_dtype, grad_dtype):
    n = 10_007
    p0 = torch.randn(n) * torch.logspace(-6, 4, n)  # many binades, fp16 overflow and subnormals included
    p, _, _, out = run_ours(p0, [torch.randn(n).to(grad_dtype)], steps_kw=dict(HP, weight_decay=0.0),
                            out_dtype=out_dtype)
    assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16))


def test_large_tensor_over_2_pow_24():
    n = 2**24 + 37
    p0 = torch.randn(n)
    grads = [torch.randn(n).to(torch.bfloat16)]
    kw = dict(HP, weight_decay=0.1)
    p, m, v, out = run_ours(p0, grads, steps_kw=kw, out_dtype=torch.bfloat16)
    rp, rm, rv = torch_reference(p0, grads, steps_kw=kw)
    assert_weights_close(p, rp, 1)
    assert torch.equal(m, rm) and torch.equal(v, rv)
    assert torch.equal(out, p.to(torch.bfloat16))


@needs_native
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_isas_threads_and_chunks_bitwise_equal(grad_dtype, state_dtype, restore_isa):
    """Every ISA path, thread count and chunking gives the same bits (lengths cover every tail)."""
    n = 3 * 65_536 + 45
    p0, g = torch.randn(n), torch.randn(n).to(grad_dtype)
    kw = dict(HP, weight_decay=0.01, adamw_mode=False, grad_scale=0.25)

    def one(isa, **extra):
        _native.set_isa(isa)
        torch.manual_seed(0)
        m, v = (torch.rand(n) * 0.1).to(state_dtype), (torch.rand(n) * 0.01).to(state_dtype)
        p, out = p0.clone(), torch.empty(n, dtype=torch.float16)
        fused_adam_step(p, g, m, v, step=3, out=out, **kw, **extra)
        return p, m, v, out

    base = one(_isas()[0])
    for isa in _isas():
        for extra in ({"num_threads": 1}, {"num_threads": 2}, {"chunk_size": 1000, "num_threads": 2}):
            for a, b in zip(base, one(isa, **extra)):
                assert torch.equal(a, b), (isa, extra)


def test_on_chunk_in_order_and_final():
    n = 10_000
    p, g, m, v = torch.randn(n), torch.randn(n).to(torch.bfloat16), torch.zeros(n), torch.zeros(n)
    out = torch.zeros(n, dtype=torch.bfloat16)
    seen = []

    def on_chunk(lo, hi):
        assert torch.equal(out[lo:hi], p[lo:hi].to(torch.bfloat16))  # the chunk is final when announced
        seen.append((lo, hi))

    fused_adam_step(p, g, m, v, step=1, **HP, weight_decay=0.0, out=out, on_chunk=on_chunk, chunk_size=3000)
    assert seen == [(0, 3000), (3000, 6000), (6000, 9000), (9000, 10000)]
    seen.clear()
    fused_adam_step(p, g, m, v, step=2, **HP, weight_decay=0.0, out=out, on_chunk=on_chunk)
    assert seen == [(0, n)]  # DEFAULT_CHUNK > n


def test_bf16_states_within_bound():
    """bf16 moments, rounded to nearest-even, against fp32 moments: max |dw| <= 0.01 * lr * steps."""
    n, steps = 50_000, 50
    g = torch.Generator().manual_seed(1)
    p32 = torch.randn(n, generator=g)
    p16 = p32.clone()
    m32, v32 = torch.zeros(n), torch.zeros(n)
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    for step in range(1, steps + 1):
        grad = (torch.randn(n, generator=g) * 0.98**step + 0.1).to(torch.bfloat16)
        kw = dict(HP, step=step, weight_decay=0.01)
        fused_adam_step(p32, grad, m32, v32, **kw)
        fused_adam_step(p16, grad, m16, v16, **kw)
    assert (p16 - p32).abs().max().item() <= 0.01 * HP["lr"] * steps
    assert (m16.float() - m32).abs().max().item() <= 2**-6 * m32.abs().max().item()  # measured 0.0075
    assert ((v16.float() - v32) / v32).abs().max().item() <= 0.1  # measured 0.033: lost small increments


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_fallback_warns_once_and_matches(monkeypatch, adamw_mode, state_dtype):
    n, steps = 5003, 3
    p0 = torch.randn(n)
    grads = [torch.randn(n).to(torch.bfloat16) for _ in range(steps)]
    kw = dict(HP, weight_decay=0.02)
    monkeypatch.setenv("ZERO_OFFLOAD_NO_NATIVE", "1")
    monkeypatch.setattr(fa, "_warned", False)
    _native.load(reload=True)
    try:
        assert not fa.native_available()
        with pytest.warns(RuntimeWarning, match="native host Adam kernel unavailable") as record:
            p, m, v, out = run_ours(p0, grads, steps_kw=kw, adamw_mode=adamw_mode, state_dtype=state_dtype,
                                    out_dtype=torch.bfloat16, on_chunk=lambda lo, hi: None, chunk_size=2000)
        assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    finally:
        monkeypatch.delenv("ZERO_OFFLOAD_NO_NATIVE")
        _native.load(reload=True)
    rp, rm, rv = torch_reference(p0, grads, steps_kw=kw, adamw_mode=adamw_mode)
    if state_dtype == torch.float32:  # torch's fused kernel: its own order of ops, a few ulps away
        torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-9)
    else:
        assert (p - rp).abs().max().item() <= 0.01 * HP["lr"] * steps
    assert torch.equal(out, p.to(torch.bfloat16))


def one_pass_fallback(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                      bias_correction, grad_scale, out):
    """The torch fallback as it was before issue 20: one pass over the whole partition, its fp32 temporaries
    as large as the partition."""
    g = grad.float() if grad.dtype != torch.float32 else grad
    if grad_scale != 1.0:
        g = g * grad_scale
    if bias_correction and exp_avg.dtype == torch.float32:
        fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
        fused([master], [g], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))], lr=lr, beta1=beta1,
              beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    else:
        m = exp_avg.float() if exp_avg.dtype != torch.float32 else exp_avg
        v = exp_avg_sq.float() if exp_avg_sq.dtype != torch.float32 else exp_avg_sq
        if weight_decay != 0.0:
            if adamw_mode:
                master.mul_(1.0 - lr * weight_decay)
            else:
                g = g.add(master, alpha=weight_decay)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        bc1 = 1.0 - beta1**step if bias_correction else 1.0
        bc2_sqrt = math.sqrt(1.0 - beta2**step) if bias_correction else 1.0
        master.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-lr / bc1)
        if m is not exp_avg:
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
    if out is not None:
        out.copy_(master)


@pytest.mark.parametrize("grad_dtype,state_dtype,adamw_mode,bias_correction,grad_scale", [
    (torch.bfloat16, torch.float32, True, True, 0.5),       # torch's fused AdamW
    (torch.float32, torch.float32, False, True, 1.0),       # torch's fused Adam (L2), the gradient used as is
    (torch.float16, torch.bfloat16, True, True, 0.37),      # AdamW's ops on fp32 copies of bf16 moments
    (torch.float32, torch.bfloat16, False, True, 1.0),      # L2 added to a copy: the caller's gradient kept
    (torch.bfloat16, torch.float32, True, False, 2.0),      # no bias correction: AdamW's ops in place
])
def test_fallback_in_chunks_is_bitwise_one_pass(monkeypatch, grad_dtype, state_dtype, adamw_mode, bias_correction,
                                                 grad_scale):
    """Issue 20: the fallback runs in pieces of DEFAULT_CHUNK elements (no temporary the size of the partition)
    and gives the bits of one pass over the whole partition, on_chunk still called per chunk_size."""
    n, steps = 2 * fa.DEFAULT_CHUNK + 1_000_003, 2      # three pieces, the last not a multiple of 16
    g = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(grad_dtype) for _ in range(steps)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.02, adamw_mode=adamw_mode,
              bias_correction=bias_correction, grad_scale=grad_scale)
    monkeypatch.setenv("ZERO_OFFLOAD_NO_NATIVE", "1")
    monkeypatch.setattr(fa, "_warned", True)
    _native.load(reload=True)
    try:
        chunks = []
        kept = [x.clone() for x in grads]
        p, m, v, out = run_ours(p0, grads, steps_kw={}, state_dtype=state_dtype, out_dtype=torch.bfloat16,
                                on_chunk=lambda lo, hi: chunks.append((lo, hi)), chunk_size=3_000_000, **kw)
        p2, m2, v2, _ = run_ours(p0, grads, steps_kw={}, state_dtype=state_dtype, **kw)   # one call, in pieces
    finally:
        monkeypatch.delenv("ZERO_OFFLOAD_NO_NATIVE")
        _native.load(reload=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, kept))
    assert chunks == [(0, 3_000_000), (3_000_000, n)] * steps
    rp, rm, rv = p0.clone(), torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
    for step, grad in enumerate(grads, 1):
        one_pass_fallback(rp, grad, rm, rv, step, out=None, **kw)
    for ours in ((p, m, v), (p2, m2, v2)):
        assert all(torch.equal(a, b) for a, b in zip(ours, (rp, rm, rv)))
    assert torch.equal(out, rp.to(torch.bfloat16))


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_matches_torch_over_groups(adamw_mode):
    torch.manual_seed(0)
    shapes = [(37, 5), (1000,), (3, 3, 3)]
    ref_params = [torch.randn(s, requires_grad=True) for s in shapes]
    params = [p.detach().clone().requires_grad_(True) for p in ref_params]

    def groups(ps):
        return [{"params": ps[:2], "lr": 2e-3, "weight_decay": 0.1}, {"params": ps[2:], "lr": 5e-4}]

    opt = CPUAdam(groups(params), betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, adamw_mode=adamw_mode)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = ref_cls(groups(ref_params), betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, foreach=False)
    steps = 6
    for _ in range(steps):
        for p, rp in zip(params, ref_params):
            rp.grad = torch.randn_like(rp)
            p.grad = rp.grad.clone()
        opt.step()
        ref.step()
    for p, rp in zip(params, ref_params):
        assert_weights_close(p.detach(), rp.detach(), steps, lr=2e-3)
        if adamw_mode:
            assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[rp]["exp_avg_sq"])


def test_cpu_adam_16bit_grads_outputs_bf16_states_and_on_chunk():
    p = torch.randn(300, requires_grad=True)
    opt = CPUAdam([p], lr=1e-2, state_dtype=torch.bfloat16)
    out = torch.empty(300, dtype=torch.float16)
    calls = []
    opt.step(grads=[[torch.randn(300).half()]], grad_scale=0.5, outputs=[[out]],
             on_chunk=lambda gi, pi, lo, hi: calls.append((gi, pi, lo, hi)))
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(out, p.detach().half())
    assert calls == [(0, 0, 0, 300)]
    with pytest.raises(ValueError, match="state_dtype"):
        CPUAdam([p], state_dtype=torch.float16)


def _args(n=8):
    return dict(master=torch.zeros(n), grad=torch.zeros(n, dtype=torch.bfloat16), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n))


@pytest.mark.parametrize("name,bad,match", [
    ("master", torch.zeros(8, dtype=torch.float64), "master must have dtype"),
    ("grad", torch.zeros(8, dtype=torch.int32), "grad must have dtype"),
    ("grad", torch.zeros(9, dtype=torch.bfloat16), "grad has 9 elements"),
    ("exp_avg", torch.zeros(7), "exp_avg has 7 elements"),
    ("exp_avg_sq", torch.zeros(8, dtype=torch.bfloat16), "exp_avg_sq must have exp_avg's dtype"),
    ("exp_avg", torch.zeros(4, 2), "exp_avg must be 1-D"),
    ("grad", torch.zeros(16)[::2], "grad must be 1-D and contiguous"),
    ("master", torch.zeros(8, device="meta"), "master must be a CPU tensor"),
    ("out", torch.zeros(8), "out must have dtype"),
    ("out", torch.zeros(3, dtype=torch.bfloat16), "out has 3 elements"),
    ("master", [0.0] * 8, "master must be a torch.Tensor"),
])
def test_bad_input_names_the_argument(name, bad, match):
    args = _args()
    args[name] = bad
    with pytest.raises(ValueError, match=match):
        fused_adam_step(**args, step=1, **HP, weight_decay=0.0)


def test_bad_step():
    with pytest.raises(ValueError, match="step must be >= 1"):
        fused_adam_step(**_args(), step=0, **HP, weight_decay=0.0)


@needs_native
def test_set_isa_rejects_unknown_name():
    with pytest.raises(ValueError, match="name must be one of"):
        _native.set_isa("sse9")
    assert _native.set_isa(None) in _native.ISA_NAMES
