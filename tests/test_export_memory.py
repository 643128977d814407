"""full_state_dict gathers the model piece by piece: the device never holds more than the largest parameter
in fp32 (the bound the GPU check asserts with torch.cuda.max_memory_allocated), and the result is exact.
Here the engine's counter; the host memory it costs, measured from the process: test_process_memory.py."""
import pytest
import torch

import zero_offload
from dist_utils import run_ranks
from reference import engine_config
from toy_model import make_model


CASES = [(2, "cpu"), (3, "none")]


def _export(configs):
    out = []
    for config in configs:
        engine = zero_offload.initialize(make_model(), config)
        out.append((engine.full_state_dict(), engine.zero.export_stats["peak_device_bytes"]))
    return out


@pytest.fixture(scope="module")
def exports():
    return run_ranks(_export, 2, [engine_config(stage, offload, 1, ws=2) for stage, offload in CASES])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_export_holds_at_most_the_largest_parameter(exports, case):
    results = [per_rank[case] for per_rank in exports]
    reference = dict(make_model().named_parameters())
    largest = max(p.numel() for p in reference.values()) * 4
    for state, peak in results:
        assert 0 < peak <= 2 * largest
        assert peak <= largest          # piece by piece: never more than one parameter
        assert set(state) == set(reference)
        for name, value in state.items():
            assert torch.equal(value, reference[name].detach()), name
