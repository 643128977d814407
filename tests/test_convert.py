"""``zero-offload convert`` (issue 30, item 3): a checkpoint rewritten offline, on one process and without the
model's code, resumes exactly in the framework it was converted for: training goes on to the weights of plain
AdamW's uninterrupted N + M run with the same warm-up schedule, within 1e-5."""
from __future__ import annotations

import json

from zero_offload.cli import main

from deepspeed_peer import (N, ds_resume, ds_train_and_save, max_diff, needs_deepspeed, our_config, ours_resume,
                            ours_train_and_save, reference)
from dist_utils import run_ranks


def _ours_save(path: str, stage: int) -> None:
    """zero-offload trains N steps and saves its own checkpoint (client_state {"epoch": 7})."""
    import warnings
    import torch.distributed as dist
    import zero_offload
    from deepspeed_peer import batches, groups, loss_of, make_model, my_half
    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make_model()
        engine = zero_offload.initialize(model, our_config(stage, True), groups(model))
    try:
        for x in batches(N):
            engine.backward(loss_of(engine, my_half(x, rank, world)))
            engine.step()
        engine.save_checkpoint(path, client_state={"epoch": 7})
    finally:
        engine.close()


def test_ours_to_dcp_and_back_resumes_exactly(tmp_path, capsys):
    run_ranks(_ours_save, 2, str(tmp_path / "ours"), 3)
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    assert "wrote" in capsys.readouterr().out
    result, _ = ours_resume(str(tmp_path / "dcp"), 2, True)       # the engine reads DCP itself
    assert max_diff(result, reference()) <= 1e-5
    (tmp_path / "config.json").write_text(json.dumps(our_config(1, False)))
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "back"), "--to", "zero-offload",
                 "--config", str(tmp_path / "config.json")]) == 0
    result, _ = ours_resume(str(tmp_path / "back"), 1, False)
    assert max_diff(result, reference()) <= 1e-5


def test_a_dcp_source_without_a_config_is_refused_naming_the_flag(tmp_path, capsys):
    run_ranks(_ours_save, 1, str(tmp_path / "ours"), 2)
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "back"), "--to", "zero-offload"]) == 2
    assert "name the training config with --config" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x"), "--to", "dcp"]) == 2
    assert f"'{tmp_path / 'nowhere'}' does not exist" in capsys.readouterr().err


@needs_deepspeed
def test_deepspeed_to_ours_and_ours_to_universal_resume_exactly(tmp_path):
    """DeepSpeed's ZeRO checkpoint converted to ours resumes here; ours converted to universal resumes in
    DeepSpeed."""
    run_ranks(ds_train_and_save, 2, str(tmp_path / "ds"), 2, False)
    assert main(["convert", str(tmp_path / "ds"), str(tmp_path / "ours"), "--to", "zero-offload"]) == 0
    result, client_state = ours_resume(str(tmp_path / "ours"), 3, True)
    assert client_state == {"epoch": 7}
    assert max_diff(result, reference()) <= 1e-5
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "uc"), "--to", "deepspeed-universal"]) == 0
    results = run_ranks(ds_resume, 1, str(tmp_path / "uc"), 1, True)
    assert max_diff(results[0], reference()) <= 1e-5


@needs_deepspeed
def test_the_convert_check_sees_a_lost_schedule(tmp_path, monkeypatch):
    """Power: a conversion engine without the checkpoint's LR schedule writes a checkpoint whose resumed run ends
    elsewhere."""
    from zero_offload.checkpoint import convert
    run_ranks(ours_train_and_save, 1, str(tmp_path / "uc"), 2, True)
    config = convert._config
    monkeypatch.setattr(convert, "_config", lambda *a: {k: v for k, v in config(*a).items() if k != "scheduler"})
    assert main(["convert", str(tmp_path / "uc"), str(tmp_path / "ours"), "--to", "zero-offload",
                 "--config", _write_config(tmp_path)]) == 0
    result, _ = ours_resume(str(tmp_path / "ours"), 2, True)
    assert max_diff(result, reference()) > 1e-4


def _write_config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(our_config(2, True)))
    return str(path)
