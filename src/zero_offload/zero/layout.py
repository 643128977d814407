"""Where each parameter's elements live across the ranks' optimizer partitions.

Checkpoints record this layout and map parameters by name from one layout into another, which is what lets
a checkpoint written by N ranks at one ZeRO stage load into M ranks at another.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from zero_offload.zero.flat import FlatParams

__all__ = ["Piece", "ParamPlacement", "GroupLayout", "place_slots", "contiguous_layout"]


@dataclass(frozen=True)
class Piece:
    """``length`` elements of a flattened parameter, from ``param_offset``, stored in ``rank``'s partition
    at ``part_offset``."""
    rank: int
    part_offset: int
    param_offset: int
    length: int


@dataclass(frozen=True)
class ParamPlacement:
    name: str
    shape: tuple[int, ...]
    numel: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class GroupLayout:
    """One param group: each rank's partition holds ``partition_numel`` elements."""
    partition_numel: int
    params: tuple[ParamPlacement, ...]

    def to_json(self) -> dict:
        return {"partition_numel": self.partition_numel,
                "params": [{"name": p.name, "shape": list(p.shape), "numel": p.numel,
                            "pieces": [[c.rank, c.part_offset, c.param_offset, c.length] for c in p.pieces]}
                           for p in self.params]}

    @classmethod
    def from_json(cls, data: dict) -> "GroupLayout":
        return cls(data["partition_numel"], tuple(
            ParamPlacement(p["name"], tuple(p["shape"]), p["numel"], tuple(Piece(*c) for c in p["pieces"]))
            for p in data["params"]))


def place_slots(slots: Iterable, size: int, base: int = 0) -> list[ParamPlacement]:
    """Where each slot's elements go when the run of elements the slots sit in is cut into consecutive pieces
    of ``size`` elements, piece r to rank r: element e of the run lands in rank ``e // size``'s partition at
    ``base + e % size``.

    ``slots``: objects with ``name``, ``shape``, ``numel`` and ``offset``/``end`` (element range in the run), as
    `FlatParams` slots (``base`` 0) and stage-3 unit slots (shards stored from ``base`` in the group partition) are.
    """
    placements = []
    for s in slots:
        pieces = []
        for r in range(s.offset // size, (s.end - 1) // size + 1) if s.numel else ():
            lo, hi = max(s.offset, r * size), min(s.end, (r + 1) * size)
            pieces.append(Piece(r, base + lo - r * size, lo - s.offset, hi - lo))
        placements.append(ParamPlacement(s.name, tuple(s.shape), s.numel, tuple(pieces)))
    return placements


def contiguous_layout(flat: FlatParams, partitions: int) -> GroupLayout:
    """The layout of a flat buffer cut into ``partitions`` equal contiguous partitions (stages 0-2)."""
    size = flat.padded_numel // partitions
    return GroupLayout(size, tuple(place_slots(flat.slots, size)))
