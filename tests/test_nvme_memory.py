"""Memory with the optimizer states on NVMe: a process training a model whose fp32 master weights and Adam
moments are 2 GB keeps its peak anonymous RSS (sampled from /proc/self/status while it trains) below the
16-bit parameters + gradients + the NVMe buffer pool + 300 MB."""
import json
import os
import subprocess
import sys
import textwrap

NUMEL = 170_000_000           # x 12 bytes of fp32 master, exp_avg, exp_avg_sq = 2.04 GB on disk

SCRIPT = textwrap.dedent(r"""
    import json, sys, threading, time
    import torch
    import zero_offload

    def rss_anon():
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith('RssAnon:'):
                    return int(line.split()[1]) * 1024

    class Big(torch.nn.Module):
        # One large bf16 parameter; the loss touches a slice, so autograd's gradient is one full-size tensor.
        def __init__(self, n):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
        def forward(self, x):
            return (self.w[:x.numel()].float() * x).sum()

    n, path = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(2)
    cfg = {"train_batch_size": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 20_000_000, "sub_group_size": 24 << 20,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 3,
                                                       "pipeline_read": True, "pipeline_write": True}},
           "aio": {"intra_op_parallelism": 2}}
    engine = zero_offload.initialize(Big(n), cfg)
    peak = [rss_anon()]
    done = False
    def sample():
        while not done:
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    x = torch.ones(1024)
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    done = True
    t.join()
    mem = engine.memory_breakdown()
    w = engine.module.w
    print(json.dumps({"peak": peak[0], "mem": mem, "params": w.numel() * w.element_size(),
                      "w0": w[0].float().item(), "bytes_on_disk": sum(v["bytes"] for v in mem.values() if v["side"] == "nvme")}))
""")


def test_peak_rss_bounded_by_the_pool(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(NUMEL), str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    mem = out["mem"]
    grads = NUMEL * 2                                  # autograd's bf16 gradient of the parameter
    grads += mem["grad_partition"]["bytes"] + mem["buckets"]["bytes"]
    pool = mem["nvme_buffers"]["bytes"]                # the NVMe buffer pool: all host optimizer state
    assert mem["master"]["side"] == "nvme" and mem["master"]["bytes"] >= 4 * NUMEL
    assert pool == 3 * 12 * (24 << 20)
    budget = out["params"] + grads + pool + 300 * 2**20
    assert out["bytes_on_disk"] >= 12 * NUMEL          # the states really are on disk, not in memory
    assert out["w0"] != 0.0                            # and the step really updated the parameters
    assert out["peak"] < budget, (out["peak"], budget, mem)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))   # swap files removed at exit
