"""fp32 exactness with the optimizer states on NVMe: stages 2 and 3, world sizes 1 and 2, accumulation 1 and 3,
sub-groups far smaller than a partition and both pipelining modes; parameters after 5 steps match plain
AdamW on one process to 1e-5."""
import itertools

import pytest

from dist_utils import run_ranks
from reference import assert_norms_match, engine_config, engine_runs, reference_run

# (stage, gas, pipeline): pipeline on = read-ahead and write-behind through a 3-buffer pool
CASES = [(stage, gas, stage == 3 or gas == 3) for stage, gas in itertools.product((2, 3), (1, 3))]
ATOL = 1e-5


def nvme_config(path, stage, gas, pipeline, ws):
    cfg = engine_config(stage, "nvme", gas, ws=ws, sub_group_size=3000)
    cfg["zero_optimization"]["offload_optimizer"].update(
        nvme_path=str(path), buffer_count=3, pipeline_read=pipeline, pipeline_write=pipeline)
    if stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    cfg["aio"] = {"block_size": 8192, "intra_op_parallelism": 2}
    return cfg


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("nvme")
    out = {}
    for ws in (1, 2):
        configs = [nvme_config(path, *case, ws=ws) for case in CASES]
        per_case = engine_runs(configs) if ws == 1 else run_ranks(engine_runs, 2, configs)[0]
        out.update({(ws, *case): res for case, res in zip(CASES, per_case)})
    return out, path


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("stage,gas,pipeline", CASES)
def test_nvme_matches_adamw(results, ws, stage, gas, pipeline):
    ref_params, ref_losses = reference_run(gas=gas, ws=ws)
    masters, params, losses = results[0][(ws, stage, gas, pipeline)]
    for name, ref in ref_params.items():
        assert (masters[name] - ref).abs().max().item() <= ATOL, name
        assert (params[name] - ref).abs().max().item() <= ATOL, name
    assert losses == pytest.approx(ref_losses, abs=1e-5)


def test_swap_files_are_removed(results):
    import gc
    gc.collect()
    left = [p for p in results[1].rglob("*") if p.is_file()]
    assert left == [], left


@pytest.mark.parametrize("ws", (1, 2))
def test_nvme_clipping_matches_adamw(tmp_path, ws):
    """Clipped steps with the states on NVMe (stage 2 and stage 3 with accumulation): clip_grad_norm_ + AdamW,
    and the global norm equals clip_grad_norm_'s."""
    cases = [(2, 1, True), (3, 3, True)]
    configs = [nvme_config(tmp_path, *case, ws=ws) for case in cases]
    for cfg in configs:
        cfg["gradient_clipping"] = 1.0
    res = engine_runs(configs, with_norms=True) if ws == 1 else run_ranks(engine_runs, 2, configs, 5, True)[0]
    for (stage, gas, _), (masters, params, losses, norms) in zip(cases, res):
        ref, ref_losses, ref_norms = reference_run(gas=gas, clip=1.0, ws=ws, with_norms=True)
        assert_norms_match(norms, ref_norms)
        for name, r in ref.items():
            assert (masters[name] - r).abs().max().item() <= ATOL, (stage, gas, name)
            assert (params[name] - r).abs().max().item() <= ATOL, (stage, gas, name)
        assert losses == pytest.approx(ref_losses, abs=1e-5)
