"""The Hugging Face stack's own DeepSpeed paths, unchanged, under ``zero-offload run`` (issue 57): each command
runs once with DeepSpeed 0.19.8 itself (CPU accelerator) and once under the stand-in; losses and the fp32 weights
agree within 1e-5. transformers' Trainer with ``TrainingArguments(deepspeed=...)`` at stage 2 and 3 with the
optimizer offloaded, on 1 and 2 ranks, resumed from its own checkpoints, and from a ZeRO-3 ``from_pretrained``.
"""
import importlib.util
import shutil
from pathlib import Path

import pytest

from stand_in_runs import assert_agree as _agree, launch

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed (the peer these runs compare with) is not installed")

_PEER: dict = {}


def _launch(under_stand_in: bool, work: Path, world: int, *args) -> dict:
    return launch("stand_in_trainer.py", under_stand_in, work, world, *args)


def _peer(key, tmp_path_factory, world, *args) -> dict:
    if key not in _PEER:
        _PEER[key] = _launch(False, tmp_path_factory.mktemp("deepspeed"), world, *args)
    return _PEER[key]


@pytest.mark.parametrize("stage, world", [(3, 1), (2, 2), (3, 2)])   # stage 2 at one rank: left out for CI time
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
