"""Export: one state dict / one safetensors file with the model's own names, loadable into a fresh model."""
import pytest
import torch
from safetensors.torch import load_file

import zero_offload
from dist_utils import run_ranks
from reference import engine_config
from toy_model import batch, make_model
from zero_offload.cli import main


def _train_and_save(cfg, path):
    engine = zero_offload.initialize(make_model(), cfg)
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(2):
        x, y = batch(step, 2 * engine.world_size)
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        engine.step()
    engine.save_checkpoint(path)
    return engine.full_state_dict()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("ws", [1, 2])
def test_consolidate_returns_the_masters(tmp_path, ws, stage):
    cfg = engine_config(stage, "cpu", 1, precision="bf16", ws=ws)
    full = _train_and_save(cfg, tmp_path) if ws == 1 else run_ranks(_train_and_save, 2, cfg, tmp_path)[0]
    state = zero_offload.consolidate(tmp_path)
    assert list(state) == list(make_model().state_dict())     # every name, tied head.weight included
    assert all(torch.equal(state[n], full[n]) for n in full)
    assert state["head.weight"] is state["wte.weight"]
    make_model(seed=3).load_state_dict(state, strict=True)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_safetensors_file_loads_into_a_fresh_model(tmp_path, dtype):
    _train_and_save(engine_config(1, "none", 1), tmp_path / "ckpt")
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(tmp_path / "ckpt"), "--out", str(out), "--dtype", dtype]) == 0
    tensors = load_file(out)
    fresh = make_model(seed=3)
    assert all(t.dtype == (torch.float32 if dtype == "fp32" else torch.bfloat16) for t in tensors.values())
    assert set(tensors) == set(fresh.state_dict())
    fresh.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)   # tied head.weight too
    trained = make_model(seed=3)
    trained.load_state_dict(zero_offload.consolidate(tmp_path / "ckpt"), strict=True)
    x, y = batch(9, 2)
    tol = 0 if dtype == "fp32" else 0.05
    assert abs(fresh(x, y).item() - trained(x, y).item()) <= tol


def test_consolidate_errors_name_the_problem(tmp_path, capsys):
    assert main(["consolidate", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    _train_and_save(engine_config(2, "cpu", 1), tmp_path / "ckpt")
    shard = next((tmp_path / "ckpt").glob("*/rank00000.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(zero_offload.CheckpointError, match="rank00000.safetensors' is corrupted"):
        zero_offload.consolidate(tmp_path / "ckpt")
