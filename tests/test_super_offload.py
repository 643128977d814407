"""``offload_optimizer.super_offload``: the host step speculated during backward is exact.

- fp32 at stages 2 and 3 (the optimizer offloaded to host memory or NVMe; at stage 3 also the parameters), 1 and
  2 ranks, accumulation 1 and 3, clipping off, clipping that fires on some steps and not others, and heavy clipping
  (coefficient <= 0.01 at every step): within 1e-5 of ``torch.optim.AdamW`` on one process, and bitwise the plain
  engine's run;
- heavy clipping only at step 1 and at a later step (the loss scaled up 1000x there): against AdamW with
  ``clip_grad_norm_``, the speculated step kept exactly where clipping did not fire and redone where it did;
- an fp16 overflow step in the middle leaves masters and moments as they were and the step count unchanged;
- the second bank is counted (``speculative_state``: host memory, or a second set of swap files) and the estimate
  predicts it;
- bad combinations are refused, naming the keys.
The 16-bit lockstep matrix (`test_exact16`), the power tests (`test_power`) and the simulated streams
(`test_simulated_streams`) cover it too.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

import zero_offload
from dist_utils import run_ranks
from reference import (LR, MICRO, WD, assert_estimated, engine_config, engine_runs, one_step_breakdown,
                       reference_run)
from toy_model import batch, make_model
from zero_offload.config import ConfigError
from zero_offload.estimate import estimate_memory
from zero_offload.optim.fused_adam import native_available

ATOL = 1e-5


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise with the native kernel (the speculative kernel is the in-place one reading other buffers); within
    fp32 rounding on torch's fallback, whose fused kernel rounds a vector body and a scalar tail differently, so
    that a piece starting elsewhere than the plain step's chunks may differ in the last bit."""
    return torch.equal(a, b) if native_available() else torch.allclose(a, b, rtol=1e-6, atol=1e-7)
CLIPS = ("off", "some", "heavy")
OFFLOADS = ("cpu", "nvme")
CASES = list(itertools.product((2, 3), (1, 3), CLIPS, OFFLOADS))


def spec_config(stage: int, gas: int, clip: float, ws: int, super_offload: bool = True, offload: str = "cpu",
                nvme_path: str | None = None) -> dict:
    """super_offload (or not) with the states in host memory, or (``nvme``) in swap files of 3000-element
    sub-groups under ``nvme_path``."""
    cfg = engine_config(stage, offload, gas, clip, ws=ws)
    zero = cfg["zero_optimization"]
    zero["offload_optimizer"]["super_offload"] = super_offload
    if offload == "nvme":
        zero["offload_optimizer"].update(nvme_path=nvme_path, buffer_count=3)
        zero["sub_group_size"] = 3000
        cfg["aio"] = {"block_size": 8192}
    if stage == 3:
        zero.update(offload_param={"device": "cpu"}, stage3_param_persistence_threshold=0,
                    stage3_max_reuse_distance=0)
    return cfg


def clip_value(kind: str, gas: int, ws: int) -> float:
    """``gradient_clipping`` for ``kind``, from the unclipped reference's norms: off; between the smallest and the
    largest norm, so it fires on some steps only; 1/200 of the smallest (coefficient <= 0.005 every step)."""
    if kind == "off":
        return 0.0
    _, _, norms = reference_run(gas=gas, ws=ws, with_norms=True)
    return sorted(norms)[len(norms) // 2] if kind == "some" else min(norms) / 200


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("super-offload-nvme"))
    out = {}
    for ws in (1, 2):
        configs = []
        for stage, gas, kind, offload in CASES:
            clip = clip_value(kind, gas, ws)
            configs += [spec_config(stage, gas, clip, ws, True, offload, path),
                        spec_config(stage, gas, clip, ws, False, offload, path)]
        runs = engine_runs(configs, with_norms=True) if ws == 1 else run_ranks(engine_runs, 2, configs, 5, True)[0]
        for i, case in enumerate(CASES):
            out[(ws, *case)] = (runs[2 * i], runs[2 * i + 1])
    return out


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("stage,gas,kind,offload", CASES)
def test_matches_adamw_and_the_plain_engine(results, ws, stage, gas, kind, offload):
    ref_params, ref_losses = reference_run(gas=gas, clip=clip_value(kind, gas, ws), ws=ws)
    (masters, params, losses, _), (plain_masters, plain_params, plain_losses, _) = \
        results[(ws, stage, gas, kind, offload)]
    for name, ref in ref_params.items():
        assert (masters[name] - ref).abs().max().item() <= ATOL, name
        assert (params[name] - ref).abs().max().item() <= ATOL, name
        assert same(masters[name], plain_masters[name]), f"{name}: not bitwise the plain engine's"
        assert same(params[name], plain_params[name]), name
    assert losses == pytest.approx(plain_losses, rel=0 if native_available() else 1e-6)
    assert losses == pytest.approx(ref_losses, abs=1e-5)


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("gas", (1, 3))
def test_clip_kinds_engage(results, ws, gas):
    """"some" clips some steps and not others; "heavy" clips every step to a coefficient <= 0.01."""
    norms = results[(ws, 2, gas, "off", "cpu")][0][3]
    some, heavy = clip_value("some", gas, ws), clip_value("heavy", gas, ws)
    assert any(n > some for n in norms) and any(n <= some for n in norms), (norms, some)
    assert all(heavy / n <= 0.01 for n in norms), (norms, heavy)


# -- heavy clipping at step 1 and at a later step only ---------------------------------------------------------
SPIKES = {0: 1000.0, 3: 1000.0}     # the loss (so the gradient) scaled up at these steps
STEPS = 6


def _spike_reference(clip: float):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        x, y = batch(step, MICRO)
        opt.zero_grad()
        (model(x, y) * SPIKES.get(step, 1.0)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _spike_run(config: dict):
    engine = zero_offload.initialize(make_model(), config)
    kept, norms = [], []
    for step in range(STEPS):
        x, y = batch(step, MICRO)
        engine.backward(engine(x, y) * SPIKES.get(step, 1.0))
        engine.step()
        kept.append(engine.timings.get("host_step_kept"))
        norms.append(engine.last_grad_norm)
    state = engine.full_state_dict()
    engine.close()
    return state, kept, norms


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("stage", (2, 3))
def test_heavy_clipping_at_the_first_and_a_later_step(stage, offload, tmp_path):
    plain_norms = _spike_run(spec_config(stage, 1, 0.0, 1, False, offload, str(tmp_path)))[2]
    clip = 2 * max(n for i, n in enumerate(plain_norms) if i not in SPIKES)   # fires at the spikes only
    state, kept, norms = _spike_run(spec_config(stage, 1, clip, 1, True, offload, str(tmp_path)))
    assert all(clip / norms[i] <= 0.01 for i in SPIKES), norms
    assert kept == [0.0 if i in SPIKES else 1.0 for i in range(STEPS)]     # redone where clipping fired
    plain = _spike_run(spec_config(stage, 1, clip, 1, False, offload, str(tmp_path)))[0]
    ref = _spike_reference(clip)
    for name, value in ref.items():
        assert (state[name] - value).abs().max().item() <= ATOL, name
        assert same(state[name], plain[name]), name


# -- fp16 overflow in the middle ----------------------------------------------------------------------------
OVERFLOW_STEP = 2


def _overflow_run(config: dict):
    engine = zero_offload.initialize(make_model(), config)
    states = []
    for step in range(5):
        x, y = batch(step, MICRO)
        loss = engine(x, y)
        engine.backward(loss * (1e30 if step == OVERFLOW_STEP else 1.0))     # inf in the fp16 gradients
        engine.step()
        states.append({k: v.clone() for k, v in engine.full_state_dict().items()})
    engine.close()
    return states, engine.skipped_steps


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("stage", (2, 3))
def test_fp16_overflow_is_undone(stage, offload, tmp_path):
    cfg = spec_config(stage, 1, 1.0, 1, True, offload, str(tmp_path))
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    states, skipped = _overflow_run(cfg)
    plain_cfg = copy.deepcopy(cfg)
    plain_cfg["zero_optimization"]["offload_optimizer"]["super_offload"] = False
    plain_states, plain_skipped = _overflow_run(plain_cfg)
    assert skipped == plain_skipped == 1
    for name in states[0]:
        assert torch.equal(states[OVERFLOW_STEP][name], states[OVERFLOW_STEP - 1][name]), name   # no step taken
        assert same(states[-1][name], plain_states[-1][name]), name


# -- memory and configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", (1.0, 0.3))
@pytest.mark.parametrize("precision,moment_bytes", [("fp32", 4), ("bf16", 2)])
def test_second_bank_is_counted_and_estimated(precision, moment_bytes, fraction):
    """The second bank (or, ``super_offload_fraction`` < 1, the undo bank of that share of each group's partition)
    in the breakdown, and every kind the estimate counts to the byte (the share-sized 16-bit staging and the ring
    included)."""
    cfg = spec_config(2, 1, 0.0, 1)
    if fraction < 1:
        cfg["zero_optimization"]["offload_optimizer"]["super_offload_fraction"] = fraction
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True, "bf16_optimizer_states": True}
    held = one_step_breakdown(cfg)
    engine = zero_offload.initialize(make_model(), cfg)
    groups = [m.numel() for m in engine.zero.adam.speculation.masters]
    engine.close()
    share = sum(int(n * fraction) for n in groups)
    assert sum(groups) == held["master"]["numel"] and (share < sum(groups)) == (fraction < 1)
    assert held["speculative_state"] == {"bytes": share * (4 + 2 * moment_bytes), "numel": 3 * share, "side": "host"}
    est = estimate_memory(make_model(), cfg, 1, accelerator=False)
    assert est.host["speculative_state"] == held["speculative_state"]["bytes"]
    assert_estimated(held, cfg)


@pytest.mark.parametrize("stage", (2, 3))
def test_the_second_bank_of_swap_files_is_counted_and_estimated(stage, tmp_path):
    """On NVMe the second bank is a second set of state files (``speculative_state`` on the nvme side) and the
    updated parameters wait in a landing buffer (``param_incoming`` at stage 2, ``param_staging`` beside stage 3's
    host shards); the estimate predicts every kind the engine holds."""
    cfg = spec_config(stage, 1, 0.0, 1, True, "nvme", str(tmp_path))
    held = one_step_breakdown(cfg)
    files = sum(held[k]["bytes"] for k in ("master", "exp_avg", "exp_avg_sq"))
    assert held["speculative_state"]["side"] == "nvme" and held["speculative_state"]["bytes"] == files
    landing = held["param_incoming" if stage == 2 else "param_staging"]["bytes"]
    assert landing >= 4 * held["master"]["numel"] - 4 * 3000 * 2     # the partition again (fp32), padding aside
    assert_estimated(held, cfg)


@pytest.mark.parametrize("change,named", [
    ({"offload_optimizer": {"device": "cpu", "super_offload": True, "delayed_param_update": True}},
     "delayed_param_update"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "super_offload": True}}, "zero_optimization.stage"),
    ({"offload_optimizer": {"device": "none", "super_offload": True}}, "offload_optimizer.device"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True},
      "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, "offload_param.device"),
])
def test_bad_combinations_are_refused(change, named):
    cfg = engine_config(2, "cpu")
    cfg["zero_optimization"].update(change)
    with pytest.raises(ConfigError, match="super_offload") as err:
        zero_offload.initialize(make_model(), cfg)
    assert named in str(err.value)


def test_torch_optimizer_is_refused():
    cfg = spec_config(2, 1, 0.0, 1)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(ConfigError, match="super_offload.*Adam"):
        zero_offload.initialize(make_model(), cfg)


# -- overlap: the recorded step graph (item 4) ----------------------------------------------------------------
def test_the_recorded_step_starts_the_host_step_before_backward_ends():
    """Under simulated streams the engine's recorded step (`step_graph`) has the first speculated piece's host step
    start before the boundary backward's last module ends; replayed with the 10B plan's durations, the speculative
    step hides part of the host step that plain offload exposes, and the step is shorter."""
    from zero_offload.estimate.step_graph import Phases, Structure, predict_step, recording
    from zero_offload.offload import timeline
    spec = Structure(stage=2, offload_param=False, delayed=False, accumulates=False, fp32=False, speculative=True)
    tl, marks = recording(spec)
    third = marks[-1][0]                                  # the last recorded step
    ops = [o for o in tl.ops if o.id >= third]
    pred = timeline.predict(tl, lambda o: 1.0 if o.kind in ("backward", "host_step") else 0.0)
    backward_end = max(pred.times[o.id][1] for o in ops if o.kind == "backward")
    host = [o for o in ops if o.kind == "host_step"]
    assert host and all("host-step" in o.lane for o in host), {o.lane for o in host}
    assert min(pred.times[o.id][0] for o in host) < backward_end
    phases = dict(forward_s=0.60, backward_s=1.59, down_s=0.37, up_s=0.42, add_s=0.0, host_s=1.79)
    plain = predict_step(Structure(2, False, False, False, False), Phases(**phases))
    spec_step = predict_step(spec, Phases(**phases))
    assert spec_step.step_s < plain.step_s - 0.5, (spec_step.lines(), plain.lines())
    assert "host step thread" in spec_step.bars


@pytest.mark.parametrize("offload", OFFLOADS)
def test_timings_report_the_hidden_share(offload, tmp_path):
    engine = zero_offload.initialize(make_model(), spec_config(2, 1, 0.0, 1, True, offload, str(tmp_path)))
    for step in range(3):
        x, y = batch(step, MICRO)
        engine.backward(engine(x, y))
        engine.step()
    t = engine.timings
    engine.close()
    assert t["host_step_kept"] == 1.0 and 0.0 <= t["host_step_hidden_s"] <= t["host_step_s"]
