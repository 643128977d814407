"""Offload options of issue 9: communication_data_type, bf16 Adam moments (bf16.bf16_optimizer_states),
pin_memory's default, and the errors for their misuse."""
import pytest
import torch

import zero_offload
from dist_utils import run_ranks
from reference import engine_config, engine_runs, reference_run

COMM_CASES = [(2, "fp32"), (2, "bf16"), (3, "bf16")]


def _comm_config(stage, comm):
    cfg = engine_config(stage, "cpu", 1, ws=2)
    cfg["communication_data_type"] = comm
    return cfg


@pytest.fixture(scope="module")
def comm_results():
    return run_ranks(engine_runs, 2, [_comm_config(s, c) for s, c in COMM_CASES])[0]


@pytest.mark.parametrize("case", range(len(COMM_CASES)))
def test_communication_data_type(comm_results, case):
    """fp32 reductions are exact; bf16 reductions round each bucket to bf16 (8 mantissa bits) before the
    sum, so after 5 AdamW steps (lr 3e-3) the weights stay within 2 steps' size of the reference."""
    stage, comm = COMM_CASES[case]
    ref, _ = reference_run(ws=2)
    masters = comm_results[case][0]
    err = max((masters[n] - ref[n]).abs().max().item() for n in ref)
    if comm == "fp32":
        assert err <= 1e-5
    else:
        assert 0 < err <= 2 * 3e-3


def _bf16_moment_bounds(beta1, beta2, steps, u=2.0**-8):
    """(sum_t E_t, sum_t U_t) of test_bf16_moments_stay_within_the_stated_bound's derivation."""
    import math
    rho = beta1 * (1 + u) / math.sqrt(beta2)
    r = [(1 - beta1) * math.sqrt(sum((beta1**2 / beta2)**j for j in range(k)) / (1 - beta2))
         for k in range(1, steps + 1)]
    e_sum = u_sum = 0.0
    for t in range(1, steps + 1):
        c, grow = math.sqrt(1 - beta2**t) / (1 - beta1**t), (1 - u) ** (-t / 2)
        e_sum += c * (u * grow * sum(rho ** (t - k) * r[k - 1] for k in range(1, t + 1)) + r[t - 1] * (grow - 1))
        u_sum += c * r[t - 1]
    return e_sum, u_sum


class _SameGradients(torch.nn.Module):
    """loss = sum(a * xa) + sum(b * xb): the gradients are the inputs exactly, whatever the weights are."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(37, 5, generator=g))
        self.b = torch.nn.Parameter(torch.randn(1001, generator=g) * 0.02)

    def forward(self, xa, xb):
        return (self.a * xa).sum() + (self.b * xb).sum()


def _same_gradients_run(config, steps):
    import math
    engine = zero_offload.initialize(_SameGradients(), config)
    n = 37 * 5 + 1001
    g = torch.Generator().manual_seed(1)
    scale = torch.exp(torch.empty(n).uniform_(math.log(1e-4), 0.0, generator=g))   # per element, 1e-4 .. 1
    fading = torch.rand(n, generator=g) < 0.5   # large first, then small: v's increments fall under its ulp
    for step in range(steps):
        x = torch.randn(n, generator=g) * scale * torch.where(fading & (step > 0), 0.01, 1.0)
        x = x.to(torch.bfloat16)
        engine.backward(engine(x[:185].view(37, 5), x[185:]))
        engine.step()
    return engine.full_state_dict()


def test_bf16_moments_stay_within_the_stated_bound():
    """bf16 Adam moments (bf16.bf16_optimizer_states) against fp32 moments, within bounds that hold on any CPU.

    The kernel computes in fp32 and stores exp_avg (m) and exp_avg_sq (v) rounded to nearest-even bf16: relative
    error <= u = 2**-8 per store (fp32's 2**-24 is left out below and covered by the slack). Every ISA path
    stores the same bytes (tests/test_fused_adam_rounding.py), so nothing below depends on the CPU.

    1. The same gradients in both runs (a model whose gradients do not depend on its weights). From zero
       moments, Cauchy-Schwarz gives |m_k| <= R_k sqrt(v_k), R_k = (1 - b1) sqrt(sum_{j<k} (b1^2/b2)^j / (1 - b2)),
       and v_t >= b2^(t-k) v_k. v is a sum of non-negative terms, so stored it stays within (1 +- u)^t of v_t.
       m's error obeys |e_t| <= b1 (1 + u) |e_{t-1}| + u |m_t|, so |e_t| <= u sqrt(v_t) sum_k rho^(t-k) R_k,
       rho = b1 (1 + u) / sqrt(b2). The update m_t / bc1_t / (sqrt(v_t / bc2_t) + eps) then moves by at most
           E_t = sqrt(bc2_t) / bc1_t x [u (1 - u)^(-t/2) sum_k rho^(t-k) R_k + R_t ((1 - u)^(-t/2) - 1)]
       (eps only shrinks it), and decoupled weight decay shrinks an existing difference, so
       |w_bf16 - w_fp32| <= lr sum_t E_t: 1.5 u lr after one step, 0.074 lr after 5 with betas (0.9, 0.999)
       (measured 0.013 lr). The kernel docstring's 0.01 lr x steps is a measurement, not this worst case.
    2. The toy transformer: each run's forward sees its own rounded weights, so the gradients differ by what
       the CPU's bf16 matmuls make of a one-ulp weight difference, and Adam's normalised update does not damp
       that where a gradient nearly cancels: measured up to 0.39 lr, and 0.12 lr at blocks.0.ln2.bias, where the
       old bound (0.01 lr x steps + 2**-8 |w|, which assumed equal gradients) failed on AMD and Intel CPUs
       alike, on every ISA path. For any gradients each run's step is at most lr U_t, U_t = R_t sqrt(bc2_t) /
       bc1_t (the bf16 run's E_t more), so |w_bf16 - w_fp32| <= lr sum_t (2 U_t + E_t), about 10 lr after 5
       steps: that rules out a broken run only, so the bf16 run must also train (its loss falls).
    """
    base = engine_config(2, "cpu", 1, precision="bf16")
    bf16_states = engine_config(2, "cpu", 1, precision="bf16")
    bf16_states["bf16"]["bf16_optimizer_states"] = True
    engine = zero_offload.initialize(__import__("toy_model").make_model(), bf16_states)
    assert engine.optimizer.state_dtype == torch.bfloat16
    lr, steps = base["optimizer"]["params"]["lr"], 5
    e_sum, u_sum = _bf16_moment_bounds(0.9, 0.999, steps)
    fp32_m, bf16_m = _same_gradients_run(base, steps), _same_gradients_run(bf16_states, steps)
    for name in fp32_m:   # the slack: both runs' fp32 roundings (2**-24 each) of the updates and the weights
        bound = lr * e_sum * (1 + 2**-10) + steps * 2**-21 * fp32_m[name].abs().max().item()
        assert (fp32_m[name] - bf16_m[name]).abs().max().item() <= bound, name
    (fp32_m, _, _), (bf16_m, _, losses) = engine_runs([base, bf16_states])
    for name in fp32_m:
        bound = lr * (2 * u_sum + e_sum) * (1 + 2**-10) + steps * 2**-21 * fp32_m[name].abs().max().item()
        assert (fp32_m[name] - bf16_m[name]).abs().max().item() <= bound, name
    assert losses[-1] < losses[0]


def test_host_bytes_per_param_with_bf16_moments():
    from toy_model import batch, make_model
    cfg = engine_config(2, "cpu", 1, precision="bf16")
    cfg["bf16"]["bf16_optimizer_states"] = True
    engine = zero_offload.initialize(make_model(), cfg)
    x, y = batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    mem = engine.memory_breakdown()
    numel = mem["master"]["numel"]      # this rank's partition: one fp32 master per element
    assert mem["exp_avg"]["bytes"] == mem["exp_avg_sq"]["bytes"] == 2 * numel
    # host bytes/param with bf16 moments: fp32 master 4 + moments 2 + 2 + bf16 gradient 2 = 10, and nothing
    # else: at one micro-step per step the kernel writes the bf16 parameters over the bf16 gradient and they go up
    # from there (no staging ring; under accumulation one of at most 4 chunks of 2**21 elements)
    host = sum(v["bytes"] for v in mem.values() if v["side"] == "host")
    assert mem["param_staging"]["bytes"] == 0
    assert host == 10 * numel


def test_pin_memory_defaults_to_true_as_in_deepspeed():
    cfg = zero_offload.Config.load(engine_config(2, "cpu", 1))
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True
    assert cfg.zero_optimization.offload_param.pin_memory is True


@pytest.mark.parametrize("edit,key", [
    (lambda c: c.update(communication_data_type="fp8"), "communication_data_type"),
    (lambda c: c["zero_optimization"].update(offload_param={"device": "cpu", "delayed_param_update": True},
                                              stage=3), "offload_param.delayed_param_update"),
    (lambda c: c["zero_optimization"]["offload_optimizer"].update(dpu_warmup_steps=-1), "dpu_warmup_steps"),
])
def test_bad_offload_options_name_the_key(edit, key):
    cfg = engine_config(2, "none", 1, precision="bf16")
    edit(cfg)
    with pytest.raises(zero_offload.ConfigError, match=key.replace(".", r"\.")):
        zero_offload.Config.load(cfg)


@pytest.mark.parametrize("bucket", [50_000_000, 0], ids=["default-bucket", "no-prefetch"])
def test_stage3_forwards_without_autograd_prefetch_and_stay_exact(monkeypatch, bucket):
    """Evaluation / generate(): the first no-grad forward records its unit order and gathers on demand; later
    ones launch each module's gather while earlier modules run (the default bucket holds the whole toy model:
    every other unit is gathered at the first module's start), and none ahead with bucket 0."""
    from reference import MICRO
    from test_stage3 import ForwardLog, check_prefetch
    from toy_model import batch, make_model
    engine = zero_offload.initialize(make_model(), engine_config(
        3, "none", 1, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=bucket))
    reference = make_model()
    x, y = batch(0, MICRO)
    forwards = ForwardLog(engine.module, monkeypatch)
    losses = []
    with torch.no_grad():
        for _ in range(3):
            with forwards.logged():
                losses.append(engine(x, y).item())
    units = len({e[1] for e in forwards.logs[0] if e[0] == "gather"})    # all of them gather when recorded
    assert check_prefetch(forwards.logs, bucket) == (units - 1 if bucket else 0)
    assert losses == [pytest.approx(reference(x, y).item(), abs=1e-6)] * 3


def test_staging_ring_reuses_its_slots_and_rounds_like_the_kernel():
    from zero_offload.offload.copies import HostCopies
    from zero_offload.offload.staging_ring import StagingRing
    ring = StagingRing(HostCopies(torch.device("cpu")), torch.bfloat16, largest=10, slot_numel=3, slots=2)
    src = torch.randn(10)
    dst = torch.empty(10, dtype=torch.bfloat16)
    ring.copy_up(dst, src)
    assert len(ring.tensors()) == 2 and all(t.numel() == 3 for t in ring.tensors())
    assert torch.equal(dst, src.to(torch.bfloat16))


def test_bf16_moments_without_offload_warn_that_they_have_no_effect():
    cfg = engine_config(2, "none", 1, precision="bf16")
    cfg["bf16"]["bf16_optimizer_states"] = True
    messages = zero_offload.Config.load(cfg).no_effect_warnings()
    assert any("'bf16.bf16_optimizer_states' has no effect" in m for m in messages)


def test_deepspeeds_fp32_optimizer_states_false_is_bf16_moments():
    """DeepSpeed's ``optimizer.params.fp32_optimizer_states: false`` (its CPU Adam keeps moments in the parameters'
    dtype) gives bf16 host moments, as ``bf16.bf16_optimizer_states`` does; with fp16 it is refused by name."""
    from toy_model import make_model
    cfg = engine_config(2, "cpu", 1, precision="bf16")
    cfg["optimizer"]["params"]["fp32_optimizer_states"] = False
    engine = zero_offload.initialize(make_model(), cfg)
    try:
        assert engine.optimizer.state_dtype == torch.bfloat16
    finally:
        engine.close()
    cfg = engine_config(2, "cpu", 1, precision="fp16")
    cfg["optimizer"]["params"]["fp32_optimizer_states"] = False
    with pytest.raises(zero_offload.ConfigError, match="'optimizer.params.fp32_optimizer_states' = false"):
        zero_offload.Config.load(cfg)
