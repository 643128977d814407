"""Switching between FSDP2 and zero-offload in the middle of a run (issue 30, items 2 and 3): FSDP2 (gloo, fp32,
AdamW) trains N steps and saves a ``torch.distributed.checkpoint`` directory of ``get_state_dict(model, optimizer)``;
the engine loads it with ``engine.load_checkpoint(dir)`` and trains M more; and the other way, the engine writes one
with ``save_checkpoint(dir, format="dcp")`` that FSDP2 resumes with ``dcp.load`` and ``set_state_dict``. Either way the
result equals the uninterrupted N + M run (FSDP2 on one rank, or on two ranks each with half the batch, trains as
plain ``torch.optim.AdamW`` on the whole batch).
"""
from __future__ import annotations

import pytest
import torch

import zero_offload
from zero_offload.checkpoint import CheckpointError

from dist_utils import run_ranks

LR, WD, N, M = 1e-2, 0.01, 3, 2


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(steps)]


def _fsdp2() -> tuple[torch.nn.Module, torch.optim.Optimizer, int, int]:
    """The model under FSDP2 (each layer and the root sharded over this process group), its AdamW, rank, world."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), dist.get_rank(), dist.get_world_size()


# The layouts people write: (the model's key path, the optimizer's), dotted; "" the top level.
LAYOUTS = {"torchtitan": ("", "optimizer"), "get_state_dict": ("model", "optim"), "scripts": ("model", "optimizer"),
           "tutorial": ("app.model", "app.optim")}


def nested(layout: str, msd: dict, osd: dict, **more) -> dict:
    """``{...}`` with the model and optimizer state dicts at ``layout``'s key paths (and ``more`` at the top)."""
    out: dict = dict(more)
    for root, value in zip(LAYOUTS[layout], (msd, osd)):
        if not root:
            out.update(value)
            continue
        *parents, last = root.split(".")
        at = out
        for key in parents:
            at = at.setdefault(key, {})
        at[last] = value
    return out


def _fsdp2_save(path: str, layout: str = "get_state_dict", extra_model: str | None = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt, rank, world = _fsdp2()
    for x in batches(N):
        half = x.shape[0] // world
        model(x[rank * half:(rank + 1) * half]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    more = {extra_model: dict(msd)} if extra_model else {}         # e.g. an EMA copy of the weights beside them
    dcp.save(nested(layout, msd, osd, **more), checkpoint_id=path)


def reference() -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for x in batches(N + M):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def config(stage: int, offload: bool) -> dict:
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zc["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zc,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


def resumed(path: str, stage: int, offload: bool, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    from deepspeed_peer import scrambled_engine
    model = make_model()
    engine = scrambled_engine(model, config(stage, offload))
    try:
        assert engine.load_checkpoint(path) is None and engine.global_step == N
        for x in batches(N + M)[N:]:
            half = x.shape[0] // world
            engine.backward(engine(x[rank * half:(rank + 1) * half]).square().mean())
            engine.step()
        return [engine.full_state_dict()[n] for n, _ in model.named_parameters()]
    finally:
        engine.close()


def _resumed_on_rank(path: str, stage: int, offload: bool) -> list[torch.Tensor]:
    import torch.distributed as dist
    return resumed(path, stage, offload, dist.get_rank(), dist.get_world_size())


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("saved_on,stage,offload", [(1, 2, True), (2, 3, True), (2, 0, False)])
def test_an_fsdp2_checkpoint_resumes_exactly(tmp_path, saved_on, stage, offload):
    run_ranks(_fsdp2_save, saved_on, str(tmp_path / "dcp"))
    assert max_diff(resumed(str(tmp_path / "dcp"), stage, offload), reference()) <= 1e-5


def test_the_check_sees_moments_that_were_not_loaded(tmp_path, monkeypatch):
    """Power: the parameters loaded but Adam's moments left at zero (a weights-only resume) end elsewhere."""
    from zero_offload.checkpoint import dcp
    run_ranks(_fsdp2_save, 1, str(tmp_path / "dcp"))
    reader = dcp._reader

    def weights_only(*args):
        read = reader(*args)
        return lambda name, shape: {**read(name, shape), "exp_avg": torch.zeros(shape).reshape(-1),
                                    "exp_avg_sq": torch.zeros(shape).reshape(-1)}
    monkeypatch.setattr(dcp, "_reader", weights_only)
    assert max_diff(resumed(str(tmp_path / "dcp"), 2, True), reference()) > 1e-4


def test_two_ranks_resume_a_one_rank_fsdp2_checkpoint(tmp_path):
    run_ranks(_fsdp2_save, 1, str(tmp_path / "dcp"))
    ranks = run_ranks(_resumed_on_rank, 2, str(tmp_path / "dcp"), 2, True)
    assert max(max_diff(r, reference()) for r in ranks) <= 1e-5


def _refused(path, model: torch.nn.Module, match: str) -> None:
    """Loading ``path`` into an engine of ``model`` fails with ``match`` and leaves every master as it was."""
    engine = zero_offload.initialize(model, config(2, True))
    try:
        before = engine.full_state_dict()
        with pytest.raises(CheckpointError, match=match):
            engine.load_checkpoint(str(path))
        assert all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    finally:
        engine.close()


def test_a_damaged_or_foreign_checkpoint_is_refused_before_anything_changes(tmp_path):
    run_ranks(_fsdp2_save, 1, str(tmp_path / "dcp"))
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 5))
    _refused(tmp_path / "dcp", other, r"parameter '2.weight' has shape \[4, 16\] there and \[5, 16\]")
    data = next((tmp_path / "dcp").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])          # truncated
    _refused(tmp_path / "dcp", make_model(), rf"file '{data}' is missing or truncated")
    (tmp_path / "dcp" / ".metadata").write_bytes(b"not a pickle")
    _refused(tmp_path / "dcp", make_model(), r"\.metadata' cannot be read as DCP metadata")


def _fsdp2_resume(path: str, layout: str = "torchtitan", lambda_lr: bool = False) -> list[torch.Tensor]:
    """FSDP2 resumes zero-offload's DCP checkpoint and trains M more steps; the full parameters after. With
    ``lambda_lr`` the script has a ``LambdaLR`` (a constant factor of 1), built before the load as scripts build it:
    it adds ``initial_lr`` to the optimizer's groups, which the load then needs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt, rank, world = _fsdp2()
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0) if lambda_lr else None
    msd, osd = get_state_dict(model, opt)
    dcp.load(nested(layout, msd, osd), checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    for x in batches(N + M)[N:]:
        half = x.shape[0] // world
        model(x[rank * half:(rank + 1) * half]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _ours_save(path: str, stage: int, layout: str = "torchtitan") -> None:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = zero_offload.initialize(make_model(), config(stage, True))
    try:
        for x in batches(N):
            half = x.shape[0] // world
            engine.backward(engine(x[rank * half:(rank + 1) * half]).square().mean())
            engine.step()
        engine.save_checkpoint(path, format="dcp", **({} if layout == "torchtitan" else
                                                         {"dcp_keys": LAYOUTS[layout]}))
    finally:
        engine.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_both_ways(tmp_path, layout):
    """Issue 42, item 5: FSDP2 saves under ``layout``'s keys and the engine finds them by the parameters' names;
    the engine saves under them (``dcp_keys``) and FSDP2 loads them there. Both end on the uninterrupted run."""
    run_ranks(_fsdp2_save, 1, str(tmp_path / "theirs"), layout)
    assert max_diff(resumed(str(tmp_path / "theirs"), 2, True), reference()) <= 1e-5
    run_ranks(_ours_save, 1, str(tmp_path / "ours"), 2, layout)
    assert max_diff(run_ranks(_fsdp2_resume, 1, str(tmp_path / "ours"), layout)[0], reference()) <= 1e-5


def test_a_model_under_two_prefixes_is_refused_naming_both(tmp_path):
    """Weights twice (the model and an EMA copy) leave which to train ambiguous: refused, naming both prefixes."""
    run_ranks(_fsdp2_save, 1, str(tmp_path / "dcp"), "get_state_dict", "ema")
    _refused(tmp_path / "dcp", make_model(), r"under several prefixes: 'ema', 'model'")
    from zero_offload.checkpoint.dcp import load_dcp
    engine = zero_offload.initialize(make_model(), config(2, True))
    try:
        load_dcp(engine, tmp_path / "dcp", keys=("model", "optim"))     # named: it loads
        assert engine.global_step == N
    finally:
        engine.close()


@pytest.mark.parametrize("saved_on,stage,resumed_on", [(1, 2, 1), (2, 3, 1), (1, 2, 2)])
def test_fsdp2_resumes_a_dcp_checkpoint_written_here(tmp_path, saved_on, stage, resumed_on):
    """Issue 30, item 3: zero-offload trains N steps and writes DCP (save_checkpoint(format="dcp")); FSDP2 resumes
    it and trains M more, ending on the uninterrupted run's weights."""
    run_ranks(_ours_save, saved_on, str(tmp_path / "dcp"), stage)
    ranks = run_ranks(_fsdp2_resume, resumed_on, str(tmp_path / "dcp"))
    assert max(max_diff(r, reference()) for r in ranks) <= 1e-5
    assert not list(tmp_path.glob(".*zero-offload"))                # the staging checkpoint is gone


@pytest.mark.parametrize("saved_on", [1, 2])
def test_fsdp2_with_a_lambda_lr_resumes_a_dcp_checkpoint_written_here(tmp_path, saved_on):
    """Issue 59, item 5: an FSDP2 script with a ``LambdaLR`` (2 ranks) loads our DCP checkpoint with ``dcp.load`` and
    ``set_state_dict`` (it failed with "Missing key in checkpoint state_dict: optimizer.param_groups.0.initial_lr")
    and continues exactly."""
    run_ranks(_ours_save, saved_on, str(tmp_path / "dcp"), 2)
    ranks = run_ranks(_fsdp2_resume, 2, str(tmp_path / "dcp"), "torchtitan", True)
    assert max(max_diff(r, reference()) for r in ranks) <= 1e-5


def test_the_fsdp2_check_sees_moments_that_were_not_written(tmp_path, monkeypatch):
    """Power: a DCP checkpoint written with its moments zeroed makes FSDP2's resumed run end elsewhere."""
    from zero_offload.checkpoint.load import SavedParameters
    read = SavedParameters.read

    def zeroed(self, name, kind="master"):
        t = read(self, name, kind)
        return t if kind == "master" else torch.zeros_like(t)
    monkeypatch.setattr(SavedParameters, "read", zeroed)
    run_ranks(_ours_save, 1, str(tmp_path / "dcp"), 2)
    assert max_diff(run_ranks(_fsdp2_resume, 1, str(tmp_path / "dcp"))[0], reference()) > 1e-4


@pytest.mark.parametrize("fmt", ["dcp", "deepspeed-universal"])
def test_a_failed_foreign_save_leaves_the_checkpoint_there_as_it_was(tmp_path, monkeypatch, fmt):
    """A write that fails midway (here: reading the fifth parameter) raises naming the checkpoint, leaves the one
    already at the path byte for byte, and no temporary directory behind."""
    from zero_offload.checkpoint.load import SavedParameters
    engine = zero_offload.initialize(make_model(), config(2, True))
    try:
        for x in batches(N):
            engine.backward(engine(x).square().mean())
            engine.step()
        written = engine.save_checkpoint(str(tmp_path / "out"), format=fmt)
        before = {p.relative_to(tmp_path): p.read_bytes() for p in written.rglob("*") if p.is_file()}
        read, calls = SavedParameters.read, []

        def failing(self, name, kind="master"):
            calls.append(name)
            if len(calls) == 5:
                raise OSError("disk gone")
            return read(self, name, kind)
        monkeypatch.setattr(SavedParameters, "read", failing)
        engine.backward(engine(batches(N + 1)[-1]).square().mean())   # another state: a write in place would show
        engine.step()
        with pytest.raises(CheckpointError, match="disk gone"):
            engine.save_checkpoint(str(tmp_path / "out"), format=fmt)
    finally:
        engine.close()
    after = {p.relative_to(tmp_path): p.read_bytes() for p in written.rglob("*") if p.is_file()}
    assert after == before
    assert not [p for p in tmp_path.rglob(".*") if "tmp" in p.name or "zero-offload" in p.name], \
        list(tmp_path.rglob(".*"))


def test_save_checkpoint_refuses_an_unknown_format_or_client_state_with_dcp(tmp_path):
    engine = zero_offload.initialize(make_model(), config(2, False))
    try:
        with pytest.raises(ValueError, match="format must be 'zero-offload', 'deepspeed-universal' or 'dcp', got "
                                             "'deepspeed'"):
            engine.save_checkpoint(str(tmp_path), format="deepspeed")
        with pytest.raises(ValueError, match="client_state's keys .* must be a dict; got list"):
            engine.save_checkpoint(str(tmp_path), client_state=[1], format="deepspeed-universal")
        with pytest.raises(ValueError, match="format='dcp' has no place for client_state"):
            engine.save_checkpoint(str(tmp_path), client_state={"a": 1}, format="dcp")
    finally:
        engine.close()


def _fsdp2_save_scheduled(path: str) -> None:
    """FSDP2 (each GPT block and the root sharded) with a warm-up LR schedule (DeepSpeed's WarmupLR over torch's
    AdamW, decay and no-decay groups) trains the peer's GPT N steps and saves."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from deepspeed_peer import LR, SCHEDULE, batches, groups, loss_of, make_model, my_half
    from zero_offload.config import WarmupLRParams
    from zero_offload.optim.lr_schedules import WarmupLR
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(groups(model), lr=LR)
    schedule = WarmupLR(opt, WarmupLRParams(**SCHEDULE))
    for batch in batches(N):
        loss_of(model, my_half(batch, dist.get_rank(), dist.get_world_size())).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _ours_resume_scheduled(path: str, stage: int):
    import torch.distributed as dist
    from deepspeed_peer import ours_resume
    return ours_resume(path, stage, True, dist.get_rank(), dist.get_world_size())[0]


@pytest.mark.parametrize("saved_on,stage,resumed_on", [(2, 1, 1), (1, 3, 2)])
def test_an_fsdp2_run_mid_warm_up_resumes_on_its_schedule(tmp_path, saved_on, stage, resumed_on):
    """A DCP checkpoint carries no LR schedule; the engine's (the same warm-up) moves to the checkpoint's step, so
    the resumed run warms up on from there and ends on plain AdamW's uninterrupted N + M run with the schedule."""
    from deepspeed_peer import max_diff as by_name, reference as scheduled_reference
    run_ranks(_fsdp2_save_scheduled, saved_on, str(tmp_path / "dcp"))
    results = run_ranks(_ours_resume_scheduled, resumed_on, str(tmp_path / "dcp"), stage)
    assert max(by_name(r, scheduled_reference()) for r in results) <= 1e-5
