"""Resharding loads are streamed: a checkpoint saved by 2 ranks (stage 2, 96 MB of fp32 master weights and
Adam moments in all) loads into 1 rank with the states on NVMe while the process's anonymous RSS (sampled
from /proc/self/status) grows by at most two pieces of the stream (3 kinds x 1M fp32 elements each), far
less than the 96 MB the rank's new partition holds; the loaded state equals the checkpoint's."""
import textwrap

import torch

import zero_offload
from dist_utils import run_ranks
from memory_probe import OneVector, run_fresh
from zero_offload.checkpoint.reshard import CHUNK_NUMEL

NUMEL = 8_000_000           # x 12 bytes of fp32 master, exp_avg, exp_avg_sq = 96 MB over the 2 saving ranks


def config(**offload):
    return {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 1 << 20, "sub_group_size": 1 << 20,
                                  "offload_optimizer": offload}}


LOAD = textwrap.dedent(r"""
    import json, sys
    import torch
    import zero_offload
    from zero_offload.checkpoint import full_parameters, read_manifest, resolve_tag

    n, swap, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    sys.path.insert(0, sys.argv[4])
    from memory_probe import OneVector, peak_during
    from test_nvme_reshard_memory import config
    engine = zero_offload.initialize(OneVector(n), config(device="nvme", nvme_path=swap, buffer_count=3,
                                                          pipeline_read=True, pipeline_write=True))
    grown = peak_during(lambda: engine.load_checkpoint(ckpt))
    directory = resolve_tag(ckpt)
    manifest = read_manifest(directory)
    same = True
    for kind in ("master", "exp_avg", "exp_avg_sq"):                # each kind read back whole from the checkpoint
        saved = dict(full_parameters(directory, manifest, kind))["w"]
        same = same and torch.equal(engine.zero.adam.read_state(0, kind)[:n], saved)
    print(json.dumps({"grown": grown, "same": same, "step": engine.global_step}))
""")


def _save(path, n):
    torch.manual_seed(0)
    engine = zero_offload.initialize(OneVector(n), config(device="cpu"))
    x = torch.ones(1024)
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    engine.save_checkpoint(path)
    return engine.world_size


def test_two_to_one_reshard_load_streams(tmp_path):
    assert run_ranks(_save, 2, str(tmp_path / "ckpt"), NUMEL) == [2, 2]
    (tmp_path / "swap").mkdir()
    out = run_fresh(LOAD, NUMEL, tmp_path / "swap", tmp_path / "ckpt")
    assert out["same"] and out["step"] == 2
    piece = 3 * 4 * CHUNK_NUMEL
    assert out["grown"] <= 2 * piece, f"the load grew RssAnon by {out['grown'] / 2**20:.1f} MiB"
    assert 12 * NUMEL > 7 * piece        # what a whole partition would have cost
