"""Issue 10 items that had no test of their own: deepspeed.init_distributed, and the main job checking its
config before any data or model work."""
import json
import os
import subprocess
import sys

from zero_offload.cli import main

_SCRIPT = """
import os, torch.distributed as dist
import zero_offload.deepspeed as deepspeed
for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
    os.environ.pop(k, None)
deepspeed.init_distributed()                       # no torchrun environment: one rank, no group
assert not dist.is_initialized()
try:
    deepspeed.init_distributed(dist_init_required=True)
    raise SystemExit("no error")
except RuntimeError as e:
    assert "RANK/WORLD_SIZE" in str(e), e
deepspeed.init_distributed(dist_backend="gloo", rank=0, world_size=1, distributed_port={port},
                           dist_init_required=True)
assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
deepspeed.init_distributed()                       # a group exists: nothing more
dist.destroy_process_group()
print("ok")
"""


def test_init_distributed_creates_the_group_only_when_asked_and_possible():
    from dist_utils import _free_port
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(port=_free_port())], capture_output=True,
                         text=True, timeout=120, env={**os.environ})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_main_job_config_typo_fails_before_any_data_work(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": 2, "ofload_optimizer": {"device": "cpu"}}}))
    code = main(["train", "--out", str(tmp_path / "run"), "--steps", "2", "--config", str(config),
                 "--data", "/nonexistent/corpus"])
    err = capsys.readouterr().err
    assert code == 2
    assert "zero_optimization.ofload_optimizer" in err and "/nonexistent/corpus" not in err
    assert not (tmp_path / "run").exists()          # nothing written: not even the run directory
