"""The engine and its parts expose their state through state_dict()/load_state_dict() (zero_offload.runtime.state)."""
import ast
from pathlib import Path

import pytest
import torch

import zero_offload
from reference import engine_config
from toy_model import batch, make_model
from zero_offload.runtime.state import PartitionedOptimizerState, Stateful

SRC = Path(zero_offload.__file__).parent


def _step(engine, step):
    x, y = batch(step, 2)
    engine.backward(engine(x, y))
    engine.step()


@pytest.mark.parametrize("module", sorted(p.name for p in (SRC / "checkpoint").glob("*.py")))
def test_checkpoint_module_reads_no_private_engine_state_and_does_not_import_the_engine(module):
    tree = ast.parse((SRC / "checkpoint" / module).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "zero_offload.engine" not in imported
    private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id == "engine" and n.attr.startswith("_")]
    assert private == []
    touched = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id == "engine"}
    assert not touched & {"zero", "scaler", "lr_scheduler", "ctx", "micro_steps"}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_parts_are_stateful_and_optimizer_state_round_trips_in_chunks(stage):
    engine = zero_offload.initialize(make_model(), engine_config(stage, "cpu" if stage else "none", 1))
    for s in range(2):
        _step(engine, s)
    assert isinstance(engine, Stateful) and isinstance(engine.scaler, Stateful)
    opt = engine.optimizer_state
    assert isinstance(opt, PartitionedOptimizerState) and isinstance(opt, Stateful)
    saved = opt.state_dict()
    chunks = list(opt.state_chunks(0, chunk_numel=7))
    assert len(chunks) > 1 and chunks[0][0] == 0 and chunks[1][0] == 7
    _step(engine, 2)                                     # the live state moves on
    after = engine.full_state_dict()
    opt.load_state_dict(saved)
    restored = opt.state_dict()
    for a, b in zip(saved["groups"], restored["groups"]):
        assert a["step"] == b["step"] == 2
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[kind], b[kind])
    assert any(not torch.equal(after[n], v) for n, v in engine.full_state_dict().items())


def test_engine_state_dict_round_trip_and_missing_key_changes_nothing():
    cfg = {**engine_config(2, "cpu", 2),
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 5}}}
    engine = zero_offload.initialize(make_model(), cfg)
    for s in range(4):
        _step(engine, s)
    state = engine.state_dict()
    assert state["global_step"] == 2 and state["micro_steps"] == 4
    other = zero_offload.initialize(make_model(), cfg)
    broken = {k: v for k, v in state.items() if k != "lr_scheduler"}
    with pytest.raises(ValueError, match="lr_scheduler"):
        other.load_state_dict(broken)
    assert other.global_step == 0 and other.state_dict()["lrs"] != state["lrs"]
    other.load_state_dict(state)
    assert other.state_dict() == state
