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


def test_bf16_moments_stay_within_the_stated_bound():
    """bf16 training with bf16 Adam moments against the same run with fp32 moments: within the kernel's
    stated bound (zero_offload.optim.fused_adam: |w_bf16 - w_fp32| <= 0.01 x lr x steps) plus one bf16
    rounding of the 16-bit parameters the two runs' forwards see."""
    base = engine_config(2, "cpu", 1, precision="bf16")
    bf16_states = engine_config(2, "cpu", 1, precision="bf16")
    bf16_states["bf16"]["bf16_optimizer_states"] = True
    (fp32_m, _, _), (bf16_m, _, _) = engine_runs([base, bf16_states])
    engine = zero_offload.initialize(__import__("toy_model").make_model(), bf16_states)
    assert engine.optimizer.state_dtype == torch.bfloat16
    for name in fp32_m:
        bound = 0.01 * 3e-3 * 5 + 2 ** -8 * fp32_m[name].abs().max().item()
        assert (fp32_m[name] - bf16_m[name]).abs().max().item() <= bound, name


def test_host_bytes_per_param_with_bf16_moments():
    from toy_model import batch, make_model
    cfg = engine_config(2, "cpu", 1, precision="bf16")
    cfg["bf16"]["bf16_optimizer_states"] = True
    engine = zero_offload.initialize(make_model(), cfg)
    x, y = batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    mem = engine.memory_breakdown()
    numel = engine.zero.flats[0].partition_numel
    assert mem["exp_avg"]["bytes"] == mem["exp_avg_sq"]["bytes"] == 2 * numel
    # host bytes/param with bf16 moments: fp32 master 4 + moments 2 + 2 + bf16 gradient 2 = 10, plus a
    # staging ring of at most 4 chunks of 2**21 elements (here one chunk: the partition is smaller)
    host = sum(v["bytes"] for v in mem.values() if v["side"] == "host")
    ring = mem["param_staging"]["bytes"]
    assert 0 < ring <= min(numel, 4 * 2 ** 21) * 2
    assert host == 10 * numel + ring


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
