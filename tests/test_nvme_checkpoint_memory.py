"""Checkpoints of NVMe optimizer states are streamed: saving and loading a rank whose fp32 master weights and
Adam moments are 96 MB raises the process's anonymous RSS (sampled from /proc/self/status while it saves or
loads) by less than a quarter of that; the loaded state equals the saved one."""
import textwrap

from memory_probe import run_fresh

NUMEL = 8_000_000           # x 12 bytes of fp32 master, exp_avg, exp_avg_sq = 96 MB in the swap files

SCRIPT = textwrap.dedent(r"""
    import json, sys
    import torch
    import zero_offload

    n, swap, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    sys.path.insert(0, sys.argv[4])
    from memory_probe import OneVector, peak_during
    torch.manual_seed(0)
    cfg = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 1 << 20, "sub_group_size": 1 << 20,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": swap, "buffer_count": 3,
                                                       "pipeline_read": True, "pipeline_write": True}}}
    engine = zero_offload.initialize(OneVector(n), cfg)
    x = torch.ones(1024)
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    saved = {k: engine.zero.adam.read_state(0, k)[::997].clone() for k in ("master", "exp_avg", "exp_avg_sq")}
    save = peak_during(lambda: engine.save_checkpoint(ckpt, tag="t"))
    engine.backward(engine(x))
    engine.step()                                         # the state moves on; the load must bring it back
    load = peak_during(lambda: engine.load_checkpoint(ckpt, tag="t"))
    same = all(torch.equal(engine.zero.adam.read_state(0, k)[::997], v) for k, v in saved.items())
    print(json.dumps({"save": save, "load": load, "same": same, "step": engine.global_step}))
""")


def test_save_and_load_stream_the_state(tmp_path):
    (tmp_path / "swap").mkdir()
    out = run_fresh(SCRIPT, NUMEL, tmp_path / "swap", tmp_path / "ckpt")
    state = 12 * NUMEL
    assert out["same"] and out["step"] == 2
    for phase in ("save", "load"):
        assert out[phase] < state / 4, f"{phase} grew RssAnon by {out[phase] / 2**20:.0f} of {state / 2**20:.0f} MiB"
