"""`optimizer.type: "Lamb"` (DeepSpeed's FusedLamb semantics, issue 21 section 4) against a plain-torch LAMB
written from the paper and DeepSpeed's kernel (`lamb_reference`): stages 0-2, optimizer on the device or the
host, 1 and 2 ranks (at stages 1 and 2 tensors are cut between the ranks' partitions, so each trust ratio
needs the norms of every rank's pieces); the trust-ratio clamp both ways; the combinations refused, each
error naming its key."""
import pytest
import torch
import torch.distributed as dist

import zero_offload
from dist_utils import run_ranks
from lamb_reference import ReferenceLamb
from toy_model import batch, make_model
from zero_offload.config import Config, ConfigError

MICRO, STEPS = 2, 3
# The toy model's raw ratios span about 0.006-0.38 here: both clamps are active (checked below).
LAMB = {"lr": 0.02, "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.02}


def _config(stage, offload="none", **lamb):
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "Lamb", "params": {**LAMB, **lamb}},
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload},
                                  "reduce_bucket_size": 500}}


def _reference(ws, **lamb):
    model = make_model()
    opt = ReferenceLamb(model.parameters(), **{**LAMB, **lamb})
    ratios = []
    for step in range(STEPS):
        x, y = batch(step, MICRO * ws)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        ratios += opt.raw_ratios
    return dict(model.named_parameters()), ratios


def _run(config):
    rank = dist.get_rank() if dist.is_initialized() else 0
    ws = dist.get_world_size() if dist.is_initialized() else 1
    engine = zero_offload.initialize(make_model(), config)
    for step in range(STEPS):
        x, y = batch(step, MICRO * ws)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    return engine.full_state_dict(), type(engine.optimizer).__name__


def _check(results, ws, clamped=True, **lamb):
    ref, ratios = _reference(ws, **lamb)
    bounds = {**LAMB, **lamb}
    # both clamps exercised, or (clamped=False) none
    assert (min(ratios) < bounds["min_coeff"] and max(ratios) > bounds["max_coeff"]) == clamped
    for full, name in results:
        assert name == "Lamb"
        for key, p in ref.items():
            assert (full[key] - p.detach()).abs().max().item() <= 1e-5, key


@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "none"), (2, "cpu")])
def test_lamb_matches_the_reference_on_one_rank(stage, offload):
    _check([_run(_config(stage, offload))], 1)


def test_lamb_options_match_the_reference():
    options = {"bias_correction": False, "eps_inside_sqrt": True, "eps": 1e-6}
    _check([_run(_config(2, "cpu", **options))], 1, **options)


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu")])
def test_lamb_trust_ratios_cover_tensors_cut_between_ranks(stage, offload):
    wide = {"max_coeff": 10.0, "min_coeff": 0.001}      # no ratio clamped: a piece's own ratio would show
    config = _config(stage, offload, **wide)
    from zero_offload.zero.zero_optimizer import param_segments
    from zero_offload.zero.flat import FlatParams
    model = make_model()
    flat = FlatParams(list(model.parameters()), list(range(len(list(model.parameters())))),
                      [n for n, _ in model.named_parameters()], 2)
    half = flat.partition_numel
    assert {i for _, _, i in param_segments(flat, 0, half)[0]} & {i for _, _, i in param_segments(flat, half,
                                                                                                   2 * half)[0]}
    _check(run_ranks(_run, 2, config), 2, clamped=False, **wide)


@pytest.mark.parametrize("change,message", [
    ({"zero_optimization": {"stage": 3}}, "'optimizer.type' = 'Lamb' is built at 'zero_optimization.stage' 0-2"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
     "'zero_optimization.offload_optimizer.device' = 'nvme'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_param_update": True}}},
     "'zero_optimization.offload_optimizer.delayed_param_update'"),
])
def test_lamb_combinations_not_built_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        zero_offload.initialize(make_model(), {**_config(2), **change})


@pytest.mark.parametrize("params,message", [
    ({"amsgrad": True}, "'optimizer.params.amsgrad'"),
    ({"min_coeff": 3.0, "max_coeff": 2.0},
     "'optimizer.params.min_coeff': got 3.0, must be <= 'optimizer.params.max_coeff'"),
    ({"max_coef": 3.0}, "'optimizer.params.max_coef'; did you mean 'max_coeff'"),
    ({"adam_w_mode": True}, "unknown config key 'optimizer.params.adam_w_mode'"),
    ({"betas": [0.9, 1.0]}, "'optimizer.params.betas\\[1\\]'"),
])
def test_bad_lamb_params_name_the_key(params, message):
    with pytest.raises(ConfigError, match=message):
        Config.load({"train_batch_size": 2, "optimizer": {"type": "lamb", "params": params}})


@pytest.mark.parametrize("name", ["OneBitLamb", "OneBitAdam", "ZeroOneAdam"])
def test_one_bit_family_stays_refused(name):
    with pytest.raises(ConfigError, match=f"config key 'optimizer.type': '{name}' is accepted by DeepSpeed but not"):
        Config.load({"train_batch_size": 2, "optimizer": {"type": name}})


def test_lamb_checkpoint_resumes_exactly(tmp_path):
    def engine():
        return zero_offload.initialize(make_model(), _config(2, "cpu"))

    def train(e, steps):
        for step in steps:
            x, y = batch(step, MICRO)
            e.backward(e(x, y))
            e.step()
    whole = engine()
    train(whole, range(STEPS))
    first = engine()
    train(first, range(STEPS - 1))
    first.save_checkpoint(tmp_path)
    resumed = engine()
    resumed.load_checkpoint(tmp_path)
    train(resumed, [STEPS - 1])
    for key, p in whole.full_state_dict().items():
        assert torch.equal(resumed.full_state_dict()[key], p), key
