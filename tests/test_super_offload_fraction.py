"""``offload_optimizer.super_offload_fraction`` < 1: only the first-landing share of each partition is speculated,
in place after an undo copy (`zero_offload.hoststep.banks.UndoBank`); the rest is stepped after backward.

- fp32, stages 2 and 3, 1 and 2 ranks, accumulation 1 and 3, clipping off and clipping that fires on some steps:
  within 1e-5 of ``torch.optim.AdamW`` on one process, and bitwise the plain engine's run;
- the speculation runs and stands where clipping does not fire (some pieces stepped during backward, the rest at
  the boundary), and is dropped and redone where it does;
- power: an undo bank that does not copy back, or does not copy out, fails the comparison;
- bad values are refused, naming the key (the undo bank's bytes: `test_super_offload`'s
  ``test_second_bank_is_counted_and_estimated``).
"""
from __future__ import annotations

import pytest

import zero_offload
from dist_utils import run_ranks
from reference import MICRO, engine_config, engine_runs, reference_run
from test_super_offload import clip_value, same, spec_config
from toy_model import batch, make_model
from zero_offload.config import ConfigError
from zero_offload.hoststep import banks
from zero_offload.optim.fused_adam import native_available

ATOL = 1e-5
FRACTION = 0.3
CASES = [(2, 1, "some"), (3, 3, "some"), (2, 3, "off"), (3, 1, "off")]      # stage, gas, clipping


def fraction_config(stage: int, gas: int, clip: float, ws: int, fraction: float | None = FRACTION) -> dict:
    """super_offload speculating ``fraction`` of each partition (None: super_offload off)."""
    cfg = spec_config(stage, gas, clip, ws, super_offload=fraction is not None)
    if fraction is not None:
        cfg["zero_optimization"]["offload_optimizer"]["super_offload_fraction"] = fraction
    return cfg


def _runs(ws: int) -> list:
    configs = []
    for stage, gas, kind in CASES:
        clip = clip_value(kind, gas, ws)
        configs += [fraction_config(stage, gas, clip, ws), fraction_config(stage, gas, clip, ws, None)]
    return engine_runs(configs) if ws == 1 else run_ranks(engine_runs, 2, configs)[0]


@pytest.fixture(scope="module")
def results():
    return {ws: _runs(ws) for ws in (1, 2)}


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_adamw_and_the_plain_engine(results, ws, case):
    stage, gas, kind = CASES[case]
    ref_params, ref_losses = reference_run(gas=gas, clip=clip_value(kind, gas, ws), ws=ws)
    (masters, params, losses), (plain_masters, plain_params, plain_losses) = \
        results[ws][2 * case][:3], results[ws][2 * case + 1][:3]
    for name, ref in ref_params.items():
        assert (masters[name] - ref).abs().max().item() <= ATOL, name
        assert (params[name] - ref).abs().max().item() <= ATOL, name
        assert same(masters[name], plain_masters[name]), f"{name}: not bitwise the plain engine's"
        assert same(params[name], plain_params[name]), name
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert losses == pytest.approx(plain_losses, rel=0 if native_available() else 1e-6)


@pytest.mark.parametrize("stage,gas,kind", [(2, 1, "some"), (2, 3, "off"), (3, 1, "off")])
def test_bf16_is_bitwise_the_plain_engine(stage, gas, kind):
    """In bf16 the pieces stepped at the boundary go up through the ring (the 16-bit staging holds only the
    speculated share): parameters and masters bitwise the plain engine's."""
    clip = clip_value(kind, gas, 1)
    configs = [fraction_config(stage, gas, clip, 1, f) for f in (FRACTION, None)]
    for cfg in configs:
        cfg["bf16"] = {"enabled": True}
    (masters, params, losses), (plain_masters, plain_params, plain_losses) = [r[:3] for r in engine_runs(configs)]
    for name in plain_masters:
        assert same(masters[name], plain_masters[name]), name
        assert same(params[name], plain_params[name]), name
    assert losses == plain_losses


def _speculations(cfg: dict, steps: int = 4) -> list[tuple[str, int, int]]:
    """Per step: what the boundary did with the speculation, the elements speculated during backward (undo copies
    made) and the elements of the partitions."""
    engine = zero_offload.initialize(make_model(), cfg)
    spec = engine.zero.adam.speculation
    seen = []
    for step in range(steps):
        x, y = batch(step, MICRO)
        engine.backward(engine(x, y) * (1000.0 if step == 2 else 1.0))    # clipping fires at step 2 only
        spec.join()
        saved = sum(hi - lo for _, lo, hi, _ in spec.bank.saved)
        engine.step()
        seen.append((spec.last, saved, sum(m.numel() for m in spec.masters)))
    engine.close()
    return seen


def test_the_share_is_speculated_and_kept_or_redone():
    cfg = fraction_config(2, 1, 0.0, 1)
    _, _, norms = reference_run(with_norms=True)
    cfg["gradient_clipping"] = max(norms) * 10          # fires only where the loss is scaled up
    for step, (last, saved, numel) in enumerate(_speculations(cfg)):
        assert last == ("redone" if step == 2 else "accepted"), (step, last)
        assert 0 < saved <= FRACTION * numel, (step, saved, numel)


@pytest.mark.parametrize("broken", ("drop", "save"))
def test_power_an_undo_bank_that_does_not_restore_fails(monkeypatch, broken):
    """With clipping that fires, a bank that does not copy back (or never copied out) leaves the speculated step's
    pieces in the state that the plain step then steps again: far outside 1e-5."""
    if broken == "drop":
        monkeypatch.setattr(banks.UndoBank, "drop", lambda self: None)
    else:
        monkeypatch.setattr(banks.UndoBank, "save", lambda self, g, lo, hi: self.saved.append((g, lo, hi, 0)) or 1)
    clip = clip_value("some", 1, 1)
    masters = engine_runs([fraction_config(2, 1, clip, 1)])[0][0]
    ref_params, _ = reference_run(clip=clip)
    assert max((masters[n] - ref).abs().max().item() for n, ref in ref_params.items()) > 10 * ATOL


@pytest.mark.parametrize("change,named", [
    ({"super_offload": True, "super_offload_fraction": 0.0}, "super_offload_fraction' = 0.0 speculates nothing"),
    ({"super_offload_fraction": 0.5}, "has no effect without"),
    ({"device": "nvme", "nvme_path": "/tmp", "super_offload": True, "super_offload_fraction": 0.5},
     "needs 'zero_optimization.offload_optimizer.device' = 'cpu'"),
    ({"super_offload": True, "super_offload_fraction": 1.5}, "super_offload_fraction"),
])
def test_bad_fractions_are_refused(change, named):
    cfg = engine_config(2, "cpu")
    cfg["zero_optimization"]["offload_optimizer"].update(change)
    with pytest.raises(ConfigError, match="super_offload_fraction") as err:
        zero_offload.initialize(make_model(), cfg)
    assert named in str(err.value)


# -- the planner ----------------------------------------------------------------------------------------------
def _plan(host: str, **offload):
    from zero_offload.estimate.memory import default_plan_config
    cfg = default_plan_config()
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "delayed_param_update": False, "ratio": 1.0,
                                                     "super_offload": True, **offload}
    cfg["activation_checkpointing"] = {"cpu_checkpointing": False}     # the host memory is the bank's alone
    return zero_offload.plan("gpt2-xl", gpus=1, gpu_memory="24GB", host_memory=host, config=cfg,
                             gradient_accumulation=1, micro_batch=8, activation_checkpointing=True,
                             allow_bf16_moments=True)


def test_the_planner_sizes_the_fraction_to_the_host_memory():
    """On a 24 GB host the whole second bank does not fit beside GPT-2 XL's states: the plan speculates a share
    whose undo bank does, writes it into the config, counts it, and says so; fixed in the config, it is kept."""
    p = _plan("24GB")
    oo = p.config["zero_optimization"]["offload_optimizer"]
    assert p.batch.fits and p.batch.speculative and 0 < p.batch.fraction < 1
    assert oo["super_offload_fraction"] == p.batch.fraction
    assert p.batch.estimate.host["speculative_state"] > 0
    assert f"{p.batch.fraction:g} of each partition" in p.reasons["super_offload"]
    whole = _plan("24GB", super_offload_fraction=1.0)
    assert whole.config is None and whole.missing["host"] > 0           # nothing fits with the whole bank
    assert _plan("24GB", super_offload_fraction=0.125).batch.fraction == 0.125
