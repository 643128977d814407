"""Stage 3 with a module whose output reaches the loss on one rank only (DeepSpeed's TestZeroUnbalancedGradients):
no deadlock and no collective mismatch, and training matches AdamW on the ranks' averaged gradient.

The reduce-scatters go out in one order on every rank (the unit that got no gradient with zeros at the end of
backward) on a process group of their own, and backward gathers follow one fixed order on every rank (a unit
backward did not reach is passed over: fetched where the other ranks fetch it). With every unit released after
use (persistence threshold 0) and a module between the branch and the loss, the old single group aborted with a
gloo size mismatch in every combination of offload_param and accumulation."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_offload
from dist_utils import run_ranks

STEPS, LR, WD = 2, 1e-2, 0.01


class OneRankBranch(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk1 = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.trunk2 = nn.Linear(16, 4)

    def forward(self, x, y, use_branch: bool):
        h = torch.tanh(self.trunk1(x))
        b = self.branch(h)                 # runs on every rank (same modules in the same order) ...
        loss = F.mse_loss(self.trunk2(h), y)
        return loss + b.pow(2).mean() if use_branch else loss   # ... but reaches the loss on rank 0 only


def _data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


CONFIG = {"train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": 64}}


def _engine_run(offload):
    rank = dist.get_rank()
    cfg = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"],
                                           "offload_optimizer": {"device": offload}}}
    engine = zero_offload.initialize(OneRankBranch(), cfg)
    for step in range(STEPS):
        x, y = _data(step, rank)
        engine.backward(engine(x, y, use_branch=rank == 0))
        engine.step()
    return engine.full_state_dict()


def _reference():
    model = OneRankBranch()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(model(*_data(step, r), use_branch=r == 0) for r in (0, 1)) / 2
        loss.backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_one_rank_branch_does_not_hang_and_matches_adamw(monkeypatch, offload):
    monkeypatch.setenv("ZERO_OFFLOAD_TIMEOUT_S", "60")   # a deadlock fails in a minute, not ten
    got = run_ranks(_engine_run, 2, offload)[0]
    for name, ref in _reference().items():
        assert (got[name] - ref).abs().max().item() <= 1e-6, name


class BranchInTheMiddle(nn.Module):
    """The branch's output reaches the loss on rank 0 only, and a module runs after it (so backward gathers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk1, self.branch = nn.Linear(8, 16), nn.Linear(16, 16)
        self.mid, self.trunk2 = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, y, use_branch: bool):
        h = torch.tanh(self.trunk1(x))
        b = self.branch(h)
        h = torch.tanh(self.mid(h))
        loss = F.mse_loss(self.trunk2(h), y)
        return loss + b.pow(2).mean() if use_branch else loss


def _middle_run(offload_param, gas):
    rank, ws = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    zero = {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 300, "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": offload_param}}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
    engine = zero_offload.initialize(BranchInTheMiddle(), cfg)
    for step in range(3):
        for k in range(gas):
            x, y = _data(step * gas + k, rank)
            engine.backward(engine(x, y, use_branch=rank == 0))
            engine.step()
    out = engine.full_state_dict()
    engine.close()
    return out


def _middle_reference(gas, ws):
    model = BranchInTheMiddle()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(3):
        opt.zero_grad()
        loss = sum(model(*_data(step * gas + k, r), use_branch=r == 0) for r in range(ws) for k in range(gas))
        (loss / (ws * gas)).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("gas", [1, 3])
@pytest.mark.parametrize("offload_param", ["none", "cpu"])
def test_branch_before_a_module_trains_exactly(monkeypatch, offload_param, gas, ws):
    monkeypatch.setenv("ZERO_OFFLOAD_TIMEOUT_S", "60")
    got = run_ranks(_middle_run, 2, offload_param, gas)[0] if ws == 2 else _middle_run(offload_param, gas)
    for name, ref in _middle_reference(gas, ws).items():
        assert (got[name] - ref).abs().max().item() <= 1e-6, name


class SkippedInForward(BranchInTheMiddle):
    """Rank 1 does not run the branch at all from step ``skip_from`` on."""

    def forward(self, x, y, use_branch: bool, skip: bool = False):
        h = torch.tanh(self.trunk1(x))
        b = None if skip else self.branch(h)
        loss = F.mse_loss(self.trunk2(torch.tanh(self.mid(h))), y)
        return loss + b.pow(2).mean() if use_branch else loss


def _skipping_run(skip_from):
    rank = dist.get_rank()
    zero = {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0}
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    engine = zero_offload.initialize(SkippedInForward(), cfg)
    for step in range(3):
        x, y = _data(step, rank)
        engine.backward(engine(x, y, use_branch=rank == 0, skip=rank == 1 and step >= skip_from))
        engine.step()


@pytest.mark.parametrize("skip_from,check", [(0, None), (1, "1")])
def test_a_module_skipped_in_forward_on_one_rank_stops_every_rank_with_its_name(monkeypatch, skip_from, check):
    """From the first step on it is caught by the first micro-step's check; later, with ZERO_OFFLOAD_CHECK_GATHERS.
    Without the check the ranks' gathers disagree (gloo aborted the process on the size mismatch)."""
    monkeypatch.setenv("ZERO_OFFLOAD_TIMEOUT_S", "60")
    if check:
        monkeypatch.setenv("ZERO_OFFLOAD_CHECK_GATHERS", check)
    with pytest.raises(AssertionError) as info:
        run_ranks(_skipping_run, 2, skip_from)
    message = str(info.value)
    assert "GatherMismatch" in message and "rank 0 runs module 'branch'" in message
    assert "rank 1 runs module 'mid'" in message
