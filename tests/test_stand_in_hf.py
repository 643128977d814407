"""The Hugging Face stack's own DeepSpeed paths, unchanged, under ``zero-offload run`` (issue 57): each command
runs once with DeepSpeed 0.19.8 itself (CPU accelerator) and once under the stand-in; losses and the fp32 weights
agree within 1e-5. transformers' Trainer with ``TrainingArguments(deepspeed=...)`` at stage 2 and 3 with the
optimizer offloaded, on 1 and 2 ranks, resumed from its own checkpoints, and from a ZeRO-3 ``from_pretrained``.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed (the peer these runs compare with) is not installed")

TESTS = Path(__file__).resolve().parent
TOL = 1e-5
_PEER: dict = {}


def _command(world: int, port: int) -> list[str]:
    if world == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={port}"]


def _launch(under_stand_in: bool, work: Path, world: int, *script_args) -> dict:
    from dist_utils import _free_port
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "ZERO_OFFLOAD_AS_DEEPSPEED"}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]))
    if world == 1:      # a DeepSpeed script run as `python train.py` needs the launcher's variables under DeepSpeed
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [*_command(world, port), str(TESTS / "stand_in_trainer.py"), str(work / "out.json"), *script_args]
    if under_stand_in:
        cmd = [sys.executable, "-m", "zero_offload", "run", "--", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads((work / "out.json").read_text())
    out["weights"] = torch.load(work / "out.json.weights.pt")
    assert ("zero_offload" in out["deepspeed"]) == under_stand_in, out["deepspeed"]
    return out


def _agree(ours: dict, theirs: dict) -> None:
    assert len(ours["losses"]) == len(theirs["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])) < TOL, (ours["losses"],
                                                                                      theirs["losses"])
    assert set(ours["weights"]) == set(theirs["weights"])
    diff = max((ours["weights"][k] - theirs["weights"][k]).abs().max().item() for k in ours["weights"])
    assert diff < TOL, diff


def _peer(key, tmp_path_factory, world, *args) -> dict:
    if key not in _PEER:
        _PEER[key] = _launch(False, tmp_path_factory.mktemp("deepspeed"), world, *args)
    return _PEER[key]


@pytest.mark.parametrize("stage, world", [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_trainer_with_deepspeed_config_trains_as_deepspeed(tmp_path, tmp_path_factory, stage, world):
    args = ("--stage", str(stage), "--offload")
    theirs = _peer((stage, world), tmp_path_factory, world, *args)
    _agree(_launch(True, tmp_path, world, *args), theirs)


def test_trainer_resumes_from_its_own_checkpoint_as_deepspeed(tmp_path, tmp_path_factory):
    """Trainer's resume path (``deepspeed_load_checkpoint`` over ``global_step*``) under the stand-in: steps 3-4
    after resuming at step 2 equal DeepSpeed's uninterrupted run."""
    args = ("--stage", "3", "--offload")
    theirs = _peer((3, 1), tmp_path_factory, 1, *args)
    _launch(True, tmp_path, 1, *args)
    shutil.rmtree(tmp_path / "trainer" / "checkpoint-4")
    _agree(_launch(True, tmp_path, 1, *args, "--resume", "2"), theirs)


def test_zero3_from_pretrained_builds_under_zero_init_as_deepspeed(tmp_path, tmp_path_factory):
    """``from_pretrained`` at stage 3 enters ``deepspeed.zero.Init`` and loads through ``GatheredParameters``: the
    model is built partitioned (``ds_*`` attributes) and trains as DeepSpeed's."""
    from hf_models import build
    pretrained = tmp_path_factory.mktemp("pretrained")
    build("gpt2").save_pretrained(pretrained)
    args = ("--stage", "3", "--offload", "--pretrained", str(pretrained))
    theirs = _peer("pretrained", tmp_path_factory, 2, *args)
    _agree(_launch(True, tmp_path, 2, *args), theirs)
