"""No checkpoint file runs code when it is loaded (zero_offload.checkpoint.safe_pickle): every pickle we read
goes through an allow-list of data types, refused types are named with the option that trusts them, and a user who
trusts the file can still load it."""
import argparse
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

import zero_offload
from reference import engine_config
from toy_model import batch, make_model
from zero_offload.checkpoint import CheckpointError
from zero_offload.checkpoint.safe_pickle import UntrustedPickleError, load_torch_file

CFG = engine_config(2, "cpu", 1)


class Payload:
    """What a malicious checkpoint holds: unpickling it runs a shell command that leaves a file behind."""

    def __reduce__(self):
        return os.system, ("touch PWNED",)


def _trained(config=CFG):
    engine = zero_offload.initialize(make_model(seed=0), config)
    x, y = batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    return engine


def _weights(engine):
    return {n: t.clone() for n, t in engine.full_state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_client_state_that_would_run_a_command_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = _trained()
    engine.save_checkpoint(tmp_path / "ckpt", tag="t", client_state={"step": 1, "evil": Payload()})
    assert not (tmp_path / "PWNED").exists()
    other = zero_offload.initialize(make_model(seed=1), CFG)
    before = _weights(other)
    with pytest.raises(UntrustedPickleError, match=r"client_state.pt' names (posix|os)\.system, outside the "
                                                   r"allow-list.*trust_pickles=True \(config key "
                                                   r"'checkpoint.trust_pickles'\)"):
        other.load_checkpoint(tmp_path / "ckpt", tag="t")
    assert not (tmp_path / "PWNED").exists(), "loading ran the command the file named"
    assert _same(_weights(other), before), "a refused load changed the engine"
    assert (tmp_path / "ckpt" / "t" / "client_state.pt").is_file(), "the refused checkpoint was touched"


def test_the_user_who_trusts_the_file_loads_it_by_argument_or_config_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = _trained()
    engine.save_checkpoint(tmp_path / "ckpt", tag="t", client_state={"evil": Payload()})
    client = zero_offload.initialize(make_model(seed=1), CFG).load_checkpoint(tmp_path / "ckpt", tag="t",
                                                                             trust_pickles=True)
    assert client["evil"] == 0 and (tmp_path / "PWNED").exists()       # the command ran: the user asked for it
    (tmp_path / "PWNED").unlink()
    trusting = dict(CFG, checkpoint={"trust_pickles": True})
    loaded = zero_offload.initialize(make_model(seed=1), trusting)
    loaded.load_checkpoint(tmp_path / "ckpt", tag="t")
    assert (tmp_path / "PWNED").exists()
    assert _same(_weights(loaded), _weights(engine))


def test_an_ordinary_client_state_still_loads_as_it_was_saved(tmp_path):
    engine = _trained()
    state = {"epoch": 3, "lr": 1e-3, "name": "run", "flags": [True, None, (1, 2)], "blob": b"\x00\x01",
             "tensor": torch.arange(4.0), "array": np.arange(5, dtype=np.int32), "scalar": np.float64(2.5),
             "args": argparse.Namespace(lr=3e-4, model="gpt2", layers=[1, 2]), "nested": {"a": {"b": torch.ones(2)}},
             "dtype": torch.bfloat16, "size": torch.Size([2, 3])}
    engine.save_checkpoint(tmp_path, tag="t", client_state=state)
    got = zero_offload.initialize(make_model(seed=1), CFG).load_checkpoint(tmp_path, tag="t")
    assert got.keys() == state.keys()
    assert torch.equal(got["tensor"], state["tensor"]) and torch.equal(got["nested"]["a"]["b"], torch.ones(2))
    assert np.array_equal(got["array"], state["array"]) and got["array"].dtype == np.int32
    assert got["args"] == state["args"] and got["scalar"] == 2.5 and got["dtype"] is torch.bfloat16
    assert {k: got[k] for k in ("epoch", "lr", "name", "flags", "blob", "size")} == \
        {k: state[k] for k in ("epoch", "lr", "name", "flags", "blob", "size")}


def test_a_deepspeed_checkpoint_with_a_foreign_type_in_its_client_state_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = _trained()
    engine.save_checkpoint(tmp_path / "ds", tag="u", client_state={"evil": Payload()}, format="deepspeed-universal")
    other = zero_offload.initialize(make_model(seed=1), CFG)
    with pytest.raises(UntrustedPickleError, match=r"model_states.pt' names (posix|os)\.system"):
        other.load_checkpoint(tmp_path / "ds", tag="u")
    from zero_offload.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with pytest.raises(UntrustedPickleError, match="trust_pickles=True"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ds", tag="u")
    assert not (tmp_path / "PWNED").exists()
    weights = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ds", tag="u", trust_pickles=True)
    assert (tmp_path / "PWNED").exists() and _same(weights, _weights(engine))


def test_dcp_metadata_naming_a_command_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = _trained()
    engine.save_checkpoint(tmp_path / "dcp", format="dcp")
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload()))
    other = zero_offload.initialize(make_model(seed=1), CFG)
    with pytest.raises(UntrustedPickleError, match=r"\.metadata' names (posix|os)\.system"):
        other.load_checkpoint(tmp_path / "dcp")
    assert not (tmp_path / "PWNED").exists()


def test_convert_refuses_without_the_flag_and_names_it(tmp_path):
    engine = _trained()
    engine.save_checkpoint(tmp_path / "src", tag="t", client_state={"evil": Payload()})
    run = [sys.executable, "-m", "zero_offload", "convert", str(tmp_path / "src"), str(tmp_path / "dst"),
           "--to", "deepspeed-universal"]
    refused = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode != 0 and "outside the allow-list" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "dst").exists()
    trusted = subprocess.run(run + ["--trust-pickles"], cwd=tmp_path, capture_output=True, text=True)
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert (tmp_path / "PWNED").exists()


def test_a_damaged_client_state_is_named_as_damaged_not_as_untrusted(tmp_path):
    path = tmp_path / "client_state.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="truncated, damaged or not a checkpoint") as info:
        load_torch_file(path)
    assert not isinstance(info.value, UntrustedPickleError)


def test_the_config_key_is_checked_and_deepspeeds_checkpoint_keys_are_accepted(recwarn):
    with pytest.raises(zero_offload.ConfigError, match=r"'checkpoint.trust_pickles': got 'yes', expected true/false"):
        zero_offload.Config.from_dict(dict(CFG, checkpoint={"trust_pickles": "yes"}))
    config = zero_offload.Config.from_dict(dict(CFG, checkpoint={"tag_validation": "Fail", "load_universal": True}))
    assert config.checkpoint.trust_pickles is False
    assert any("checkpoint.tag_validation" in str(w.message) for w in recwarn.list)
