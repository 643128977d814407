"""CUDA-only checks (skipped without a GPU; run by benchmarks/gpu_validate.py section (a)).

Exactness against plain AdamW at stages 0-3 with and without offload, accumulation 1 and 3, and with the
delayed parameter update, with super_offload and with ratio 0.5 (both also over NVMe states), with the gradient
partition kept on the device; host bytes of pinned
partitions against the arithmetic; export peak memory (torch.cuda.max_memory_allocated) within 2x the largest
parameter; copies overlapping compute; stage-3 gather memory reused in stream order while the host runs ahead."""
import itertools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# fp32 on CUDA vs the CPU reference: matmul/reduction order differs, TF32 off; 5 steps of Adam at lr 3e-3.
ATOL = 2e-4


def _reference(gas):
    from reference import reference_run
    return reference_run(gas=gas)


@pytest.mark.parametrize("stage,offload,gas", [c for c in itertools.product((0, 1, 2, 3), ("none", "cpu"), (1, 3))
                                               if not (c[0] == 0 and c[1] == "cpu")])
def test_cuda_matches_adamw(stage, offload, gas):
    from reference import engine_config, engine_run
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, ref_losses = _reference(gas)
    masters, params, losses = engine_run(engine_config(stage, offload, gas))
    for name, value in ref.items():
        assert (masters[name] - value).abs().max().item() <= ATOL, name
    assert losses == pytest.approx(ref_losses, abs=1e-3)


@pytest.mark.parametrize("stage,gas", itertools.product((2, 3), (1, 3)))
def test_cuda_delayed_update_matches_its_schedule(stage, gas):
    from reference import engine_run
    from test_delayed_update import STEPS, dpu_config, dpu_reference
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _, _ = dpu_reference(gas, 1)
    masters, _, _ = engine_run(dpu_config(stage, gas, 1), STEPS)
    for name, value in ref.items():
        assert (masters[name] - value).abs().max().item() <= ATOL, name


@pytest.mark.parametrize("stage,gas,kind", itertools.product((2, 3), (1, 3), ("off", "some")))
def test_cuda_super_offload_matches_adamw(stage, gas, kind):
    """The speculated step on CUDA (pieces stepped as their copies' events complete): kept without clipping,
    redone where clipping fires, within the fp32 bound of plain AdamW either way."""
    from reference import engine_run, reference_run
    from test_super_offload import clip_value, spec_config
    torch.backends.cuda.matmul.allow_tf32 = False
    clip = clip_value(kind, gas, 1)
    ref, ref_losses = reference_run(gas=gas, clip=clip)
    masters, _, losses = engine_run(spec_config(stage, gas, clip, 1))
    for name, value in ref.items():
        assert (masters[name] - value).abs().max().item() <= ATOL, name
    assert losses == pytest.approx(ref_losses, abs=1e-3)


@pytest.mark.parametrize("stage,gas,spec", [(2, 1, False), (2, 3, True), (3, 3, False), (3, 1, True)])
def test_cuda_ratio_matches_adamw(stage, gas, spec):
    """offload_optimizer.ratio 0.5 on CUDA: the device half stepped by torch's fused AdamW, the host half by the
    host kernel, with one coefficient (clipping on)."""
    from reference import engine_run, reference_run
    from test_offload_ratio import ratio_config
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, ref_losses = reference_run(gas=gas, clip=1.0)
    masters, _, losses = engine_run(ratio_config(stage, gas, 1.0, 0.5, spec))
    for name, value in ref.items():
        assert (masters[name] - value).abs().max().item() <= ATOL, name
    assert losses == pytest.approx(ref_losses, abs=1e-3)


@pytest.mark.parametrize("stage,gas,clip", [(1, 3, 1.0), (2, 1, 0.0), (2, 3, 1.0), (3, 3, 0.0)])
def test_cuda_gradients_on_device_match_adamw(stage, gas, clip):
    """offload_optimizer.gradients_on_device on CUDA: the partition accumulated on the device and pulled down chunk
    by chunk on the copy stream while the host kernel steps the chunk before (700-element chunks: the slots reused)."""
    from reference import engine_run, reference_run
    from test_gradients_on_device import on_device_config
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, ref_losses = reference_run(gas=gas, clip=clip)
    masters, _, losses = engine_run(on_device_config(stage, gas, clip))
    for name, value in ref.items():
        assert (masters[name] - value).abs().max().item() <= ATOL, name
    assert losses == pytest.approx(ref_losses, abs=1e-3)


@pytest.mark.parametrize("stage,gas,kind", [(2, 1, "off"), (2, 3, "some"), (3, 1, "some"), (3, 3, "off")])
def test_cuda_nvme_super_offload_and_ratio_match_adamw(stage, gas, kind, tmp_path):
    """Over NVMe states on CUDA: super_offload (whole sub-groups speculated during backward, their parameters copied
    up into a device landing buffer, copied over the parameters when the step stands) and ratio 0.5 (the host half
    streamed through swap files while the device half steps)."""
    from reference import engine_run, reference_run
    from test_offload_ratio import nvme_ratio_config
    from test_super_offload import clip_value, spec_config
    torch.backends.cuda.matmul.allow_tf32 = False
    clip = clip_value(kind, gas, 1)
    ref, ref_losses = reference_run(gas=gas, clip=clip)
    (tmp_path / "ratio").mkdir()
    for cfg in (spec_config(stage, gas, clip, 1, True, "nvme", str(tmp_path)),
                nvme_ratio_config(tmp_path / "ratio", stage, gas, clip)):
        masters, _, losses = engine_run(cfg)
        for name, value in ref.items():
            assert (masters[name] - value).abs().max().item() <= ATOL, name
        assert losses == pytest.approx(ref_losses, abs=1e-3)


def test_pinned_partition_bytes_match_the_arithmetic():
    import zero_offload
    from reference import engine_config
    from toy_model import make_model
    from zero_offload.offload.pinned import is_page_locked, pinned_bytes
    before = pinned_bytes()
    cfg = engine_config(2, "cpu", 1, precision="bf16")
    engine = zero_offload.initialize(make_model(), cfg)
    flat = engine.zero.flats[0]
    part = flat.partition_numel
    # pinned: the bf16 gradient partition only. At accumulation 1 the host step writes the 16-bit parameters over
    # the gradient it has read and they go up from there (issue 27): no parameter staging; the fp32 master is not
    # copied: not pinned
    expected = part * 2
    got = pinned_bytes() - before
    assert abs(got - expected) <= 0.01 * expected, (got, expected)
    assert is_page_locked(engine.zero.partitions[0].buffer)
    assert not is_page_locked(engine.zero.adam.masters[0])


def test_export_peak_device_memory_within_twice_the_largest_parameter():
    import zero_offload
    from reference import engine_config
    from toy_model import make_model
    engine = zero_offload.initialize(make_model(), engine_config(3, "cpu", 1))
    largest = max(p.numel() for p in make_model().parameters()) * 4
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.full_state_dict()
    assert torch.cuda.max_memory_allocated() - base <= 2 * largest


def test_host_step_copies_overlap_and_are_ordered():
    """Stage 2 + offload, pinned: after a step the device parameters equal the host masters (events order
    the copies up before the next forward), and the step's copies ran on the side streams."""
    import zero_offload
    from reference import MICRO, engine_config
    from toy_model import batch, make_model
    engine = zero_offload.initialize(make_model(), engine_config(2, "cpu", 1))
    for step in range(3):
        x, y = batch(step, MICRO)
        engine.backward(engine(x, y))
        engine.step()
    torch.cuda.synchronize()
    part = engine.zero.adam.parts[0]
    assert torch.equal(part.cpu(), engine.zero.adam.masters[0])
    assert engine.zero.copies.h2d.query() and engine.zero.copies.d2h.query()


@pytest.mark.parametrize("offload_param", ("none", "cpu"))
def test_stage3_gathers_reuse_memory_while_the_host_runs_ahead(offload_param):
    """Stage 3 with the device held back by a long kernel queued first: the host runs the whole forward ahead of
    the device. A released unit's memory goes to the next gather at once, in the gather stream's order (FSDP2's
    way), and so does a host shard's upload buffer, in the copy stream's order: reserved memory grows by a few
    units, not by the whole model (record_stream would keep every released block until the host saw the device
    pass it)."""
    import zero_offload
    layers, dim = 16, 1024
    unit_bytes = dim * dim * 4
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": dim * dim,
                                 "stage3_max_live_parameters": 2 * dim * dim,
                                 "stage3_param_persistence_threshold": 0,
                                 "offload_param": {"device": offload_param}}}
    engine = zero_offload.initialize(model, cfg)
    x = torch.randn(4, dim)
    for _ in range(2):             # the first step records the order that prefetch replays
        engine.backward(engine(x).float().square().mean())
        engine.step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda._sleep(2_000_000_000)      # ~1 s of device time queued before the forward
    out = engine(x)
    grown = torch.cuda.max_memory_reserved() - base
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert grown <= 6 * unit_bytes, f"reserved grew by {grown / unit_bytes:.1f} units of {layers}"


@pytest.mark.parametrize("stage,offload", [(2, "none"), (2, "cpu"), (3, "none")])
def test_offload_states_leaves_the_engines_device_memory_near_zero(stage, offload):
    """After ``offload_states()`` the engine's device memory is near zero (allocated bytes above what was there
    before it was built: at most 1% of what it held plus 1 MiB of small tensors such as the loss scale);
    ``reload_states()`` restores it and training continues bitwise as the run that never offloaded."""
    import zero_offload
    from reference import MICRO, engine_config
    from toy_model import batch, make_model
    torch.backends.cuda.matmul.allow_tf32 = False
    runs = []
    for offloading in (False, True):
        torch.manual_seed(0)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()           # what earlier tests left: not the engine's
        engine = zero_offload.initialize(make_model(), engine_config(stage, offload, 2))
        x, y = batch(0, MICRO)
        for _ in range(3):
            engine.backward(engine(x.cuda(), y.cuda()))
            engine.step()
            if offloading:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated() - base
                engine.offload_states()
                torch.cuda.synchronize()
                after = torch.cuda.memory_allocated() - base
                assert after <= 0.01 * before + (1 << 20), (before, after)
                engine.reload_states()
        runs.append(engine.full_state_dict())
        engine.close()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_cuda_trains_through_refused_page_locking(monkeypatch):
    """Issue 42, item 3: every cudaHostRegister refused (a capped container): one PinnedMemoryWarning, the buffers
    pageable, and the run still matches AdamW."""
    from reference import engine_config, engine_run
    from test_pinned_limits import RefusingCudart
    from zero_offload.offload import pinned
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(pinned, "_cudart", RefusingCudart)
    monkeypatch.setattr(pinned, "_warned", False)
    cfg = engine_config(2, "cpu")
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
    with pytest.warns(pinned.PinnedMemoryWarning, match="ulimit -l unlimited"):
        masters, _, _ = engine_run(cfg)
    ref, _ = _reference(1)
    for name, value in ref.items():
        assert (masters[name] - value).abs().max().item() <= ATOL, name
    assert pinned.pageable_fallback_bytes() > 0
