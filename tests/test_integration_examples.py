"""The README's runnable examples for the Hugging Face Trainer, TRL and Lightning (examples/), run as users run
them: a tiny GPT-2 built from a config (nothing downloaded) fine-tuned at stage 3 with everything offloaded, saved
and loaded back with from_pretrained; TRL's SFT, DPO and GRPO on a tiny Llama at stage 3; a LightningModule at
stage 2 with ModelCheckpoint. And ``import zero_offload`` needs neither extra."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(script, *args):
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")   # run as users do
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_hf_trainer_example_fine_tunes_and_reloads(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    pytest.importorskip("accelerate", reason="the hf extra (accelerate) is not installed")
    out = _run("hf_trainer_finetune.py", "--out", str(tmp_path / "model"), "--steps", "6")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 6 steps" in out.stdout and (tmp_path / "model" / "model.safetensors").is_file()


def test_lightning_example_trains_and_checkpoints(tmp_path):
    pytest.importorskip("lightning", reason="the lightning extra is not installed")
    out = _run("lightning_zero_offload.py", "--out", str(tmp_path), "--epochs", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 8 steps" in out.stdout
    assert (tmp_path / "checkpoints" / "epoch=0-step=8.ckpt" / "checkpoint" / "manifest.json").is_file()


def test_import_zero_offload_needs_neither_extra():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import zero_offload, zero_offload.deepspeed, zero_offload.cli\n"
            "try:\n"
            "    import zero_offload.hf\n"
            "except ImportError as e:\n"
            "    assert \"pip install 'zero-offload[hf]'\" in str(e), e\n"
            "try:\n"
            "    import zero_offload.lightning\n"
            "except ImportError as e:\n"
            "    assert \"pip install 'zero-offload[lightning]'\" in str(e), e\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize("script,expect", [("trl_sft.py", "trained 4 steps"), ("trl_dpo.py", "trained 4 steps"),
                                           ("trl_grpo.py", "trained 4 steps")])
def test_trl_examples_train_at_stage_3_with_everything_offloaded(tmp_path, script, expect):
    pytest.importorskip("trl", reason="TRL (the test extra) is not installed")
    out = _run(script, "--out", str(tmp_path / "run"), "--steps", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout
    if script == "trl_dpo.py":     # the reference model is sharded: its shard on the host
        assert "'side': 'host'" in out.stdout
