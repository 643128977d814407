"""Checkpoints: exact resume in fp32, resharding across world sizes and stages, clear errors."""
import pytest
import torch

import zero_offload
from dist_utils import run_ranks
from reference import MICRO, engine_config, reference_run
from toy_model import batch, make_model
from zero_offload.checkpoint import CheckpointError

SCHED = {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 3, "warmup_type": "linear"}}


def _train(engine, steps, start=0):
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    ws = engine.world_size
    gas = engine.gradient_accumulation_steps
    for step in range(start, start + steps):
        x, y = batch(step, MICRO * gas * ws)
        for k in range(gas):
            rows = slice((rank * gas + k) * MICRO, (rank * gas + k + 1) * MICRO)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()



def _phase_save(cfg, path, steps):
    engine = zero_offload.initialize(make_model(), cfg)
    _train(engine, steps)
    engine.save_checkpoint(path, client_state={"data_step": steps})
    return engine.full_state_dict()


def _phase_resume(cfg, path, steps_after, start):
    engine = zero_offload.initialize(make_model(seed=99), cfg)   # different init: the load must overwrite it
    client = engine.load_checkpoint(path)
    assert client == {"data_step": start}
    assert engine.global_step == start
    _train(engine, steps_after, start)
    return engine.full_state_dict(), engine.get_lr()


def _uninterrupted(cfg, steps):
    engine = zero_offload.initialize(make_model(), cfg)
    _train(engine, steps)
    return engine.full_state_dict(), engine.get_lr()


def _run(ws, fn, *args):
    return fn(*args) if ws == 1 else run_ranks(fn, ws, *args)[0]


def test_resume_is_exact_in_fp32_same_world(tmp_path):
    cfg = {**engine_config(2, "cpu", 1), "scheduler": SCHED}
    full, lr = _uninterrupted(cfg, 5)
    _phase_save(cfg, tmp_path, 3)
    resumed, lr2 = _phase_resume(cfg, tmp_path, 2, 3)
    assert lr == lr2
    for n in full:
        assert torch.equal(full[n], resumed[n]), n


@pytest.mark.parametrize("save,load", [
    ((2, 2, "cpu"), (1, 2, "cpu")),     # 2 ranks -> 1
    ((1, 2, "none"), (2, 2, "none")),   # 1 rank -> 2
    ((2, 1, "none"), (2, 2, "cpu")),    # stage 1 -> stage 2 with offload, 2 ranks
    ((2, 2, "cpu"), (2, 0, "none")),    # stage 2 -> stage 0
    ((2, 2, "cpu"), (2, 3, "cpu")),     # stage 2 -> stage 3
    ((2, 3, "none"), (1, 2, "cpu")),    # stage 3, 2 ranks -> stage 2, 1 rank
    ((1, 3, "cpu"), (2, 3, "none")),    # stage 3, 1 rank -> 2 ranks
])
def test_reshard_matches_the_reference(tmp_path, save, load):
    (ws_a, stage_a, off_a), (ws_b, stage_b, off_b) = save, load
    # Batch size per step is fixed by world size; keep the global batch equal across the two phases.
    cfg_a = engine_config(stage_a, off_a, 2 // ws_a, ws=ws_a)
    cfg_b = engine_config(stage_b, off_b, 2 // ws_b, ws=ws_b)
    _run(ws_a, _phase_save, cfg_a, tmp_path, 3)
    resumed, _ = _run(ws_b, _phase_resume, cfg_b, tmp_path, 2, 3)
    ref, _ = reference_run(gas=2, ws=1, steps=5)
    for n, r in ref.items():
        assert (resumed[n] - r).abs().max().item() <= 1e-5, n


def _saved(tmp_path):
    cfg = engine_config(2, "cpu", 1)
    _phase_save(cfg, tmp_path, 2)
    return cfg, tmp_path / "global_step2"


def test_missing_tag_and_dir(tmp_path):
    cfg, _ = _saved(tmp_path)
    engine = zero_offload.initialize(make_model(), cfg)
    with pytest.raises(CheckpointError, match=r"tag .nope. does not exist .* \(tags there: global_step2\)"):
        engine.load_checkpoint(tmp_path, tag="nope")
    with pytest.raises(CheckpointError, match="does not exist"):
        engine.load_checkpoint(tmp_path / "elsewhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="latest' does not exist"):
        engine.load_checkpoint(tmp_path / "empty")


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupted_file_is_named_and_engine_unchanged(tmp_path, damage):
    cfg, ckpt = _saved(tmp_path)
    shard = ckpt / "rank00000.safetensors"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        shard.write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    else:
        shard.unlink()
    engine = zero_offload.initialize(make_model(seed=5), cfg)
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match="rank00000.safetensors"):
        engine.load_checkpoint(tmp_path)
    after = engine.full_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before) and engine.global_step == 0


def test_other_model_is_refused(tmp_path):
    _, ckpt = _saved(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    engine = zero_offload.initialize(other, engine_config(2, "cpu", 1))
    with pytest.raises(CheckpointError, match="from another model"):
        engine.load_checkpoint(tmp_path)


def test_corrupted_manifest_is_named(tmp_path):
    cfg, ckpt = _saved(tmp_path)
    (ckpt / "manifest.json").write_text("{not json")
    engine = zero_offload.initialize(make_model(), cfg)
    with pytest.raises(CheckpointError, match="manifest.json' is corrupted"):
        engine.load_checkpoint(tmp_path)


def test_resaving_a_tag_keeps_a_loadable_checkpoint(tmp_path):
    cfg = engine_config(2, "cpu", 1)
    engine = zero_offload.initialize(make_model(), cfg)
    _train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    _train(engine, 1, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    fresh = zero_offload.initialize(make_model(), cfg)
    fresh.load_checkpoint(tmp_path)
    assert fresh.global_step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "t"]


def _load_expecting_error(cfg, path):
    engine = zero_offload.initialize(make_model(seed=5), cfg)
    try:
        engine.load_checkpoint(path)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_corrupt_shard_on_one_rank_fails_every_rank_without_a_hang(tmp_path):
    cfg = engine_config(2, "cpu", 1, ws=2)
    run_ranks(_phase_save, 2, cfg, tmp_path, 1)
    shard = tmp_path / "global_step1" / "rank00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    errors = run_ranks(_load_expecting_error, 2, cfg, tmp_path)
    assert "failed on another rank" in errors[0]
    assert "rank00001.safetensors' is corrupted" in errors[1]


class WithBufferAndFrozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = make_model()
        self.register_buffer("calls", torch.zeros(()))
        self.scale = torch.nn.Parameter(torch.ones(()), requires_grad=False)

    def forward(self, x, y):
        self.calls += 1
        return self.inner(x, y) * self.scale


def test_buffers_and_frozen_parameters_are_restored(tmp_path):
    cfg = engine_config(2, "cpu", 1)
    engine = zero_offload.initialize(WithBufferAndFrozen(), cfg)
    with torch.no_grad():
        engine.module.scale.fill_(0.5)
    _train(engine, 2)
    engine.save_checkpoint(tmp_path)
    fresh = zero_offload.initialize(WithBufferAndFrozen(), cfg)
    fresh.load_checkpoint(tmp_path)
    assert fresh.module.calls.item() == 2 and fresh.module.scale.item() == 0.5
