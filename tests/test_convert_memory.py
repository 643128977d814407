"""``zero-offload convert`` streams (issue 30, item 3): converting a checkpoint holds about one parameter's state,
not the model's, into each format. Measured in a fresh interpreter (`memory_probe.peak_during`: anonymous memory,
so the pages of the memory-mapped source files do not count) on a model of many equal parameters; the power test
holds the partitions whole, as a conversion through an engine does, and is caught."""
import pytest

from memory_probe import run_fresh

N, K = 24 << 20, 24                   # 24M parameters in 24 equal ones: 288 MiB of state, 12 MiB per parameter
STATE = 12 * N

_SAVE = r'''
import json, sys, warnings
sys.path.insert(0, sys.argv[-1])
import zero_offload
from memory_probe import Pieces
warnings.simplefilter("ignore")
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
engine = zero_offload.initialize(Pieces(int(sys.argv[1]), int(sys.argv[2])), config)
engine.save_checkpoint(sys.argv[3])
engine.close()
print(json.dumps({}))
'''

_CONVERT = r'''
import json, sys, warnings
sys.path.insert(0, sys.argv[-1])
warnings.simplefilter("ignore")
import torch.distributed.checkpoint, torch.distributed.checkpoint.default_planner      # imports are not the test's
from zero_offload.checkpoint import convert, dcp_stream, formats
from zero_offload.checkpoint.convert_target import StreamedPartitions
from memory_probe import peak_during
src, dst, to, whole = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if whole:                              # power: hold every piece, as an engine holds its partitions
    keep = StreamedPartitions.load_state_chunks
    StreamedPartitions.load_state_chunks = lambda self, g, step, chunks: keep(
        self, g, step, [(lo, {k: t.clone() for k, t in piece.items()}) for lo, piece in chunks])
print(json.dumps({"peak": peak_during(lambda: convert.convert(src, dst, to))}))
'''


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("convert-memory")
    run_fresh(_SAVE, N, K, path / "ours")
    return path


@pytest.mark.parametrize("to", ["zero-offload", "deepspeed-universal", "dcp"])
def test_convert_holds_about_one_parameter(saved, to):
    peak = run_fresh(_CONVERT, saved / "ours", saved / f"out-{to}", to, 0)["peak"]
    assert peak < STATE / 4, f"convert --to {to} grew by {peak / 2**20:.0f} MiB for {STATE / 2**20:.0f} MiB of state"


def test_the_check_sees_partitions_held_whole(saved):
    peak = run_fresh(_CONVERT, saved / "ours", saved / "out-whole", "deepspeed-universal", 1)["peak"]
    assert peak > STATE * 0.9
