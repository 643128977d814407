"""Stage 3 with a module whose output reaches the loss on one rank only: the ranks' reduce-scatters still go
out in one order (no deadlock), and training matches AdamW on the ranks' averaged gradient."""
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
