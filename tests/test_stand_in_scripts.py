"""Scripts of ours written in the style of DeepSpeed-Chat's and OpenRLHF's DeepSpeed utilities (tests/
stand_in_dschat.py: DeepSpeedCPUAdam over grouped parameters, a torch LR scheduler, a frozen reference engine
built with no optimizer, ``ZeroParamStatus``-guarded ``GatheredParameters`` saving, ``clone_tensors_for_torch_save``,
``deepspeed.comm`` reductions), run unchanged under DeepSpeed 0.19.8 and under ``zero-offload run`` on 2 ranks:
losses, the reference model's logits, ``global_steps``, the optimizer's ``cur_scale``/``overflow``, the schedule
and the saved weights agree. Stage 0 with an ``offload_optimizer`` section runs, as DeepSpeed runs it (issue 57)."""
import importlib.util

import pytest

from stand_in_runs import assert_agree, launch

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed (the peer these runs compare with) is not installed")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_deepspeed_chat_style_script_trains_as_deepspeed(tmp_path_factory, stage):
    args = ("--stage", str(stage))
    theirs = launch("stand_in_dschat.py", False, tmp_path_factory.mktemp("deepspeed"), 2, *args)
    ours = launch("stand_in_dschat.py", True, tmp_path_factory.mktemp("ours"), 2, *args)
    assert_agree(ours, theirs)
