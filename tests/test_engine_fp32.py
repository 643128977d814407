"""fp32: ZeRO stages 0/1/2 x offload none/cpu x world size 1/2 x accumulation 1/3 x clipping on/off match
plain-PyTorch AdamW on one process over the global batch to 1e-5 absolute after 5 steps."""
import itertools

import pytest

from dist_utils import run_ranks
from reference import engine_config, engine_runs, reference_run

CASES = [(stage, offload, gas, clip)
         for stage, offload, gas, clip in itertools.product((0, 1, 2), ("none", "cpu"), (1, 3), (0.0, 0.05))
         if not (stage == 0 and offload == "cpu")]
ATOL = 1e-5


@pytest.fixture(scope="module")
def results():
    out = {}
    for ws in (1, 2):
        configs = [engine_config(stage, offload, gas, clip, ws=ws) for stage, offload, gas, clip in CASES]
        if ws == 1:
            per_case = engine_runs(configs)
        else:
            ranks = run_ranks(engine_runs, 2, configs)
            per_case = ranks[0]
            for case, r0, r1 in zip(CASES, ranks[0], ranks[1]):
                for name in r0[1]:   # every rank holds the same full parameters after the all-gather
                    assert (r0[1][name] == r1[1][name]).all(), (case, name)
        out.update({(ws, *case): res for case, res in zip(CASES, per_case)})
    return out


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("stage,offload,gas,clip", CASES)
def test_matches_adamw(results, ws, stage, offload, gas, clip):
    ref_params, ref_losses = reference_run(gas=gas, clip=clip, ws=ws)
    masters, params, losses = results[(ws, stage, offload, gas, clip)]
    for name, ref in ref_params.items():
        assert (masters[name] - ref).abs().max().item() <= ATOL, name
        assert (params[name] - ref).abs().max().item() <= ATOL, name
    assert losses == pytest.approx(ref_losses, abs=1e-5)


def test_clipping_is_active():
    """The clip value the matrix uses must really clip, or the clipping cases would test nothing."""
    unclipped, _ = reference_run(clip=0.0)
    clipped, _ = reference_run(clip=0.05)
    assert max((unclipped[n] - clipped[n]).abs().max().item() for n in unclipped) > 1e-4
