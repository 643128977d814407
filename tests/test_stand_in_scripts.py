"""Scripts of ours written in the style of DeepSpeed-Chat's and OpenRLHF's DeepSpeed utilities (tests/
stand_in_dschat.py: DeepSpeedCPUAdam over grouped parameters, a torch LR scheduler, a frozen reference engine
built with no optimizer, ``ZeroParamStatus``-guarded ``GatheredParameters`` saving, ``clone_tensors_for_torch_save``,
``deepspeed.comm`` reductions), run unchanged under DeepSpeed 0.19.8 and under ``zero-offload run`` on 2 ranks:
losses, the reference model's logits, ``global_steps``, the optimizer's ``cur_scale``/``overflow``, the schedule
and the saved weights agree. Stage 0 with an ``offload_optimizer`` section runs, as DeepSpeed runs it (issue 57).
And ``accelerate launch`` with a DeepSpeed config file (``"auto"`` filled by accelerate) over an accelerate loop,
and TRL's DPO with ``deepspeed=`` in its arguments."""
import importlib.util
import json
import shutil

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


@pytest.mark.parametrize("stage, world", [(2, 2), (3, 2)])   # one rank: the HF Trainer's stand-in test (CI time)
def test_accelerate_launch_with_a_deepspeed_config_file_trains_as_deepspeed(tmp_path_factory, stage, world):
    accelerate = shutil.which("accelerate")
    if accelerate is None:
        pytest.skip("accelerate's launcher is not installed")
    config = tmp_path_factory.mktemp("config") / "ds.json"
    offload = {"offload_optimizer": {"device": "cpu"}, **({"offload_param": {"device": "cpu"}} if stage == 3 else {})}
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, **offload}, "bf16": {"enabled": False}, "fp16": {"enabled": False}}))

    def launcher(port):
        return [accelerate, "launch", "--num_processes", str(world), "--main_process_port", str(port),
                "--use_deepspeed", "--deepspeed_config_file", str(config)]
    theirs = launch("stand_in_accelerate.py", False, tmp_path_factory.mktemp("deepspeed"), world, launcher=launcher)
    ours = launch("stand_in_accelerate.py", True, tmp_path_factory.mktemp("ours"), world, launcher=launcher)
    assert_agree(ours, theirs)


@pytest.mark.parametrize("stage, world", [(2, 2), (3, 2)])   # one rank: the HF Trainer's stand-in test (CI time)
def test_trl_dpo_with_deepspeed_in_its_arguments_trains_as_deepspeed(tmp_path_factory, stage, world):
    """TRL's DPOTrainer with ``DPOConfig(deepspeed=...)`` with offload: its reference model goes through
    ``deepspeed.initialize`` with no optimizer (TRL's ``prepare_deepspeed``: at stage 3 partitioned, dotted keys
    included; below it at stage 0), and at stage 3 its chunked log-prob backward reads ``ds_status`` of the saved LM
    head."""
    pytest.importorskip("trl")
    import trl_runs
    model_dir = trl_runs.save_model_dir(tmp_path_factory.mktemp("llama"))
    args = ("--trainer", "dpo", "--stage", str(stage), "--model-dir", model_dir)
    theirs = launch("stand_in_trl.py", False, tmp_path_factory.mktemp("deepspeed"), world, *args)
    ours = launch("stand_in_trl.py", True, tmp_path_factory.mktemp("ours"), world, *args)
    assert_agree(ours, theirs)
