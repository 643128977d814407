"""Who orthogonalizes each Muon matrix (`zero_offload.hoststep.muon_owners`): owners keep matrices where they lie
while the Newton-Schulz FLOPs stay balanced, and a round whose pieces all lie on their owners runs no collective.
The exactness of the scheme is tested end to end in test_muon.py."""
from types import SimpleNamespace

import pytest
import torch

from zero_offload.hoststep.muon_owners import BALANCE_SLACK, MuonOwners, assign_owners
from zero_offload.optim.muon import MuonRule, ns_flops
from zero_offload.zero.layout import GroupLayout, place_slots


def gpt_matrices(layers: int, width: int, vocab: int = 50304, context: int = 1024) -> list[tuple[int, int]]:
    """A GPT-2 model's Muon matrices in layout order: embeddings, then per layer qkv, proj, fc, out."""
    return [(vocab, width), (context, width)] + [m for _ in range(layers)
                                                 for m in ((3 * width, width), (width, width), (4 * width, width),
                                                           (width, 4 * width))]


def contiguous(shapes, world: int) -> GroupLayout:
    """The stage 1-2 layout of ``shapes`` flattened into one group and cut into ``world`` equal partitions."""
    slots, at = [], 0
    for i, shape in enumerate(shapes):
        n = shape[0] * shape[1]
        slots.append(SimpleNamespace(name=f"m{i}", shape=shape, numel=n, offset=at, end=at + n))
        at += n
    size = -(-at // world)
    return GroupLayout(size, tuple(place_slots(slots, size)))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_owners_keep_matrices_where_they_lie(world):
    """GPT-2 XL's matrices at stage 2: the owners move under 1 % of the elements across the network (balance alone
    moves 49-81 %), and no rank's FLOPs pass an even share by more than the slack."""
    shapes = gpt_matrices(48, 1600)
    layout = contiguous(shapes, world)
    local = [[sum(c.length for c in p.pieces if c.rank == r) for r in range(world)] for p in layout.params]
    total = sum(p.numel for p in layout.params)

    def moved(owners):
        return sum(p.numel - held[o] for p, held, o in zip(layout.params, local, owners)) / total

    owners = assign_owners(shapes, world, local)
    load = [sum(ns_flops(s) for s, o in zip(shapes, owners) if o == r) for r in range(world)]
    assert max(load) <= sum(load) / world * (1 + BALANCE_SLACK)
    assert moved(owners) < 0.01
    assert moved(assign_owners(shapes, world)) > 0.4


def test_balance_wins_over_locality():
    """A rank that holds every matrix still shares the FLOPs: locality never loads one rank past the slack."""
    shapes = [(64, 64)] * 4
    owners = assign_owners(shapes, 2, [[4096, 0]] * 4)
    assert sorted(owners) == [0, 0, 1, 1]
    assert assign_owners([(64, 64), (8, 8), (8, 8), (32, 32)], 2) == [0, 1, 1, 1]     # no layout: balance alone


def _owners(layout: GroupLayout, rank: int, all_to_all) -> MuonOwners:
    return MuonOwners([layout], [MuonRule(momentum=0.9)], [{}], rank, 2, replicated=False, all_to_all=all_to_all,
                      device=torch.device("cpu"))


def test_round_on_its_owners_runs_no_collective():
    """Two equal matrices, one in each rank's partition: each rank owns its own, and the round is computed without
    the all-to-all, equal to the matrix orthogonalized whole (a round with a straddling matrix does call it)."""
    from zero_offload.optim.muon import orthogonalize

    def refuse(*args):
        raise AssertionError("all_to_all called for a round whose pieces all lie on their owners")
    layout = contiguous([(16, 8), (16, 8)], 2)
    for rank in range(2):
        owners = _owners(layout, rank, refuse)
        assert [m.owner for m in owners.matrices] == [0, 1]
        update = torch.randn(128)
        result = torch.zeros(128)
        owners.orthogonalize_round(0, {0: update}, {0: result})
        expected = orthogonalize(update.view(16, 8), MuonRule(momentum=0.9)).float().reshape(-1)
        assert torch.equal(result, expected)
    calls = []
    straddling = _owners(contiguous([(8, 8), (16, 8), (8, 8)], 2), 0, lambda *a: calls.append(a))
    assert len({c.rank for c in straddling.matrices[1].pieces}) == 2
    straddling.orthogonalize_round(0, {0: torch.randn(128)}, {0: torch.zeros(128)})
    assert calls
