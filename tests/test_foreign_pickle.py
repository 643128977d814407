"""Reading DeepSpeed's pickled ``.pt`` files without DeepSpeed (`zero_offload.checkpoint.foreign_pickle`): its
objects come back as records and go out again under its class names; any class off the allow-list is refused,
naming the file and the class, without running anything."""
from __future__ import annotations

import pickle

import pytest
import torch

from zero_offload.checkpoint import CheckpointError
from zero_offload.checkpoint.foreign_pickle import Foreign, foreign_class, load_pt, save_pt


def test_a_deepspeed_record_round_trips_under_its_class_name(tmp_path):
    scaler = foreign_class("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")()
    scaler.state = {"cur_scale": 1024.0, "cur_iter": 5, "dynamic": True}
    stage = foreign_class("deepspeed.runtime.zero.config", "ZeroStageEnum")(2)
    save_pt({"loss_scaler": scaler, "zero_stage": stage, "flat": torch.arange(4.0)}, tmp_path / "x.pt")
    raw = (tmp_path / "x.pt").read_bytes()
    assert b"deepspeed.runtime.fp16.loss_scaler" in raw and b"DynamicLossScaler" in raw
    back = load_pt(tmp_path / "x.pt")
    assert isinstance(back["loss_scaler"], Foreign) and back["loss_scaler"].name == "DynamicLossScaler"
    assert back["loss_scaler"].cur_scale == 1024.0 and back["zero_stage"].args == (2,)
    assert torch.equal(back["flat"], torch.arange(4.0))


class _Payload:
    def __reduce__(self):
        import os
        return os.system, ("touch PWNED",)


def test_a_class_off_the_allow_list_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"evil": _Payload()}, tmp_path / "evil.pt", pickle_protocol=pickle.DEFAULT_PROTOCOL)
    with pytest.raises(CheckpointError, match=r"evil.pt. names (posix|os)\.system, outside the allow-list"):
        load_pt(tmp_path / "evil.pt")
    assert not (tmp_path / "PWNED").exists()


def test_a_truncated_or_missing_file_is_named(tmp_path):
    torch.save({"t": torch.zeros(1000)}, tmp_path / "x.pt")
    data = (tmp_path / "x.pt").read_bytes()
    (tmp_path / "x.pt").write_bytes(data[:len(data) // 3])
    with pytest.raises(CheckpointError, match=rf"'{tmp_path / 'x.pt'}' cannot be read"):
        load_pt(tmp_path / "x.pt")
    with pytest.raises(CheckpointError, match=rf"'{tmp_path / 'y.pt'}' is missing"):
        load_pt(tmp_path / "y.pt")
