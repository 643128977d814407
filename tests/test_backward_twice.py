"""Two backward() calls before one step() accumulate both gradients at every stage (DeepSpeed's stage 3
behaviour), matching AdamW on the summed gradient; and a config without an optimizer is an error."""
import pytest
import torch
import torch.distributed as dist

import zero_offload
from dist_utils import run_ranks
from reference import LR, MICRO, WD, engine_config
from toy_model import batch, make_model
from zero_offload.config import ConfigError

STEPS, ATOL = 3, 1e-5
CASES = [(0, "none"), (1, "none"), (1, "cpu"), (2, "none"), (2, "cpu"), (3, "none"), (3, "cpu")]


def _rows(step, part, ws, rank):
    x, y = batch(2 * step + part, MICRO * ws)
    return x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]


def _engine_runs(ws):
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = []
    for stage, offload in CASES:
        engine = zero_offload.initialize(make_model(), engine_config(stage, offload, 1, ws=ws))
        for step in range(STEPS):
            for part in (0, 1):
                engine.backward(engine(*_rows(step, part, ws, rank)))
            engine.step()
        assert engine.global_step == STEPS and engine.micro_steps == STEPS
        out.append(engine.full_state_dict())
    return out


def _reference(ws):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        opt.zero_grad()
        for part in (0, 1):
            model(*batch(2 * step + part, MICRO * ws)).backward()   # the mean over ranks of each rank's loss
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ws", [1, 2])
def test_second_backward_before_step_accumulates_at_every_stage(ws):
    results = _engine_runs(ws) if ws == 1 else run_ranks(_engine_runs, 2, ws)[0]
    ref = _reference(ws)
    for (stage, offload), got in zip(CASES, results):
        for name, value in ref.items():
            assert (got[name] - value).abs().max().item() <= ATOL, (stage, offload, name)


def test_a_config_without_optimizer_is_an_error_naming_the_key():
    cfg = engine_config(2, "cpu", 1)
    del cfg["optimizer"]
    with pytest.raises(ConfigError, match="config key 'optimizer' is missing"):
        zero_offload.initialize(make_model(), cfg)
