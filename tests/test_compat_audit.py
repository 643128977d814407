"""Issue 10 items that had no test of their own: deepspeed.init_distributed (issue 21: a one-rank group with no
launcher, as DeepSpeed), and the main job checking its config before any data or model work."""
import json
import os
import subprocess
import sys

from zero_offload.cli import main

_CLEAN = """
import os, torch, torch.distributed as dist
for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK",
          "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"):
    os.environ.pop(k, None)
import zero_offload.deepspeed as deepspeed
"""
_SCRIPT = _CLEAN + """
try:
    deepspeed.init_distributed(dist_init_required=False)      # no group and none may be made: DeepSpeed asserts
    raise SystemExit("no error")
except RuntimeError as e:
    assert "dist_init_required=False" in str(e), e
deepspeed.init_distributed()                       # no launcher environment: a one-rank group, as DeepSpeed
assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")] == [
    "0", "1", "0", "127.0.0.1", "29500"]
dist.barrier()
deepspeed.init_distributed()                       # a group exists: nothing more
dist.destroy_process_group()
os.environ.update(WORLD_SIZE="2")
os.environ.pop("RANK")
try:
    deepspeed.init_distributed()
    raise SystemExit("no error")
except RuntimeError as e:
    assert "RANK" in str(e) and "WORLD_SIZE=2" in str(e), e
deepspeed.init_distributed(dist_backend="gloo", rank=0, world_size=1, distributed_port={port})
assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
dist.destroy_process_group()
print("ok")
"""
# A typical DeepSpeed script run as `python train.py`: initialize, then torch.distributed freely.
_TYPICAL = _CLEAN + """
import torch.nn as nn
model = nn.Linear(4, 2)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}})
assert dist.get_rank() == 0 and dist.get_world_size() == 1
dist.barrier()
engine.backward(engine(torch.ones(1, 4)).sum())
engine.step()
print("ok")
"""
# Launched by mpirun (Open MPI's variables, no torchrun ones): the group has mpirun's ranks.
_MPI = _CLEAN + """
os.environ.update(OMPI_COMM_WORLD_RANK=str({rank}), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str({rank}))
deepspeed.init_distributed(dist_backend="gloo", distributed_port={port})
assert dist.get_rank() == {rank} and dist.get_world_size() == 2 and os.environ["LOCAL_RANK"] == str({rank})
dist.barrier()
dist.destroy_process_group()
print("ok")
"""


def _run(script: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _ok(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0 and out.strip().endswith("ok"), err[-2000:]


def test_init_distributed_creates_a_one_rank_group_without_a_launcher():
    from dist_utils import _free_port
    _ok(_run(_SCRIPT.format(port=_free_port())))
    _ok(_run(_TYPICAL))


def test_init_distributed_reads_an_mpi_launchers_environment():
    from dist_utils import _free_port
    port = _free_port()
    procs = [_run(_MPI.format(rank=r, port=port)) for r in range(2)]
    for proc in procs:
        _ok(proc)


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
