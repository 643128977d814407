"""The main job: one run per --out, known failures as one-line errors (exit 2), --keep-last, and a resume that
leaves no duplicate steps in metrics.jsonl."""
import json
import os
import shutil

from test_train import _args, _records
from tmpfs_utils import small_tmpfs
from zero_offload.checkpoint.lock import DirectoryLock
from zero_offload.cli import main
from zero_offload.train.loop import train


def _argv(tmp_path, *extra):
    a = _args(tmp_path)
    return ["train", "--out", a.out, "--data", a.data, "--tokenizer", "bytes", "--seq-len", "32", "--precision",
            "fp32", "--steps", "2", "--eval-every", "2", *extra]


def test_a_second_run_on_the_same_out_fails_at_once_naming_it_and_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    with DirectoryLock(out):                         # the first run, still going
        code = main(_argv(tmp_path))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"'{out}' is in use by another process (pid {os.getpid()})" in err
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_resume_cuts_metrics_back_to_the_resumed_step(tmp_path):
    train(_args(tmp_path, keep_last=5))
    run = tmp_path / "run"
    first = _records(run)
    # Killed after step 5 was logged: the newest checkpoint is step 3's.
    shutil.rmtree(run / "checkpoints" / "global_step6")
    (run / "checkpoints" / "latest").write_text("global_step3")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first if r["step"] <= 5)
                                       + '{"step": 6, "lo')   # and a torn last line
    train(_args(tmp_path, resume=True))
    steps = [r["step"] for r in _records(run) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in _records(run) if "val_loss" in r] == [0, 3, 6]


def test_keep_last_prunes_old_checkpoints(tmp_path):
    train(_args(tmp_path, save_every=1, keep_last=2))
    ckpt = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == \
        ["global_step5", "global_step6", "latest"]


def test_disk_full_in_the_main_job_is_one_line_naming_the_path(tmp_path, capsys):
    with small_tmpfs(tmp_path / "run", "160k"):
        code = main(_argv(tmp_path, "--save-every", "1"))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]    # the rest is the progress bar
    assert len(errors) == 1 and "zero-offload train: error: no space left on the device" in errors[0]
    assert str(tmp_path / "run") in errors[0] and "it needs about" in errors[0]
