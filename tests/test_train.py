"""The main job end to end on a small real text: outputs, exact fp32 resume, and clear errors."""
import json
from pathlib import Path

import pytest

from zero_offload.cli import main
from zero_offload.train.loop import TrainArgs, train

TEXT = Path(__file__).read_text() * 3   # real text that ships with the tests


def _args(tmp_path, **kw):
    data = tmp_path / "corpus.txt"
    if not data.exists():
        data.write_text(TEXT)
    base = dict(steps=6, eval_every=3, save_every=3, out=str(tmp_path / "run"), data=str(data),
                tokenizer="bytes", seq_len=32, precision="fp32")
    return TrainArgs(**{**base, **kw})


def _records(run: Path):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_short_run_writes_everything(tmp_path):
    result = train(_args(tmp_path))
    run = tmp_path / "run"
    records = _records(run)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "tokens_per_s", "step_time_s", "forward_s", "backward_s", "optimizer_s"):
        assert all(key in r for r in steps), key
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3, 6]
    assert (run / "loss.png").stat().st_size > 1000
    assert (run / "sample.txt").read_text()
    assert (run / "checkpoints" / "latest").read_text() == "global_step6"
    assert result["last_val_loss"] < result["first_val_loss"]


def test_resume_repeats_the_uninterrupted_losses(tmp_path):
    train(_args(tmp_path))
    run = tmp_path / "run"
    full = {r["step"]: r["loss"] for r in _records(run) if "loss" in r}
    # Interrupt after the step-3 checkpoint: drop what came later, then resume.
    import shutil
    shutil.rmtree(run / "checkpoints" / "global_step6")
    (run / "checkpoints" / "latest").write_text("global_step3")
    kept = [line for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["step"] <= 3]
    (run / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    train(_args(tmp_path, resume=True))
    resumed = {r["step"]: r["loss"] for r in _records(run) if "loss" in r}
    assert resumed == full


@pytest.mark.parametrize("argv,message", [
    (["--data", "/nonexistent/corpus"], "/nonexistent/corpus"),
    (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    (["--seq-len", "4096"], "--seq-len 4096 is beyond the context of preset 'tiny' (128 tokens)"),
    (["--resume"], "--resume: no checkpoint to resume from"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_input_is_a_clear_error(tmp_path, capsys, argv, message):
    code = main(["train", "--out", str(tmp_path / "run"), "--steps", "2", *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_empty_data_dir_is_an_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = main(["train", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "empty")])
    assert code == 2
    assert str(tmp_path / "empty") in capsys.readouterr().err


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--config", "--seq-len", "--steps", "--eval-every", "--save-every", "--out",
                 "--resume", "--seed", "--data", "--tokenizer"):
        assert flag in text
