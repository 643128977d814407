"""Resharding loads, streamed: this rank's new partition of each group assembled from the saved ranks' files
slice by slice, so a load into another world size or stage never holds a rank's partition whole.

The saved layout and this engine's (`zero_offload.zero.layout.GroupLayout`, by parameter name) give, for
this rank's new partition of group ``g``, a list of runs: ``length`` elements at ``new_offset`` that sit in
saved rank ``rank``'s partition of saved group ``group`` at ``saved_offset``. Adjacent runs that continue
each other in one saved partition are merged (a 2 -> 1 reshard of a stage-2 layout is a handful of runs).
`reshard_chunks` walks the runs in order and yields (offset, {kind: fp32 tensor}) pieces of at most
``chunk_numel`` elements, read with ``safe_open(...).get_slice(name)[lo:hi]`` (the file is memory-mapped:
only the slice is copied), and zeros where no parameter lands (partition padding). The pieces feed the
optimizer's ``load_state_chunks`` (`zero_offload.runtime.state.PartitionedOptimizerState`), so peak host memory is
one piece of each kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from zero_offload.checkpoint.io import CheckpointError, rank_file
from zero_offload.runtime.state import STATE_KINDS, StateChunk
from zero_offload.zero.layout import GroupLayout

__all__ = ["Run", "reshard_runs", "reshard_chunks", "check_saved_partitions", "check_rank_file", "saved_slice"]

CHUNK_NUMEL = 1 << 20     # elements per piece of each kind (4 MiB of fp32)


@dataclass(frozen=True)
class Run:
    """``length`` elements of the new partition from ``new_offset``, saved in rank ``rank``'s partition of
    saved group ``group`` from ``saved_offset``."""
    new_offset: int
    length: int
    rank: int
    group: int
    saved_offset: int


def reshard_runs(saved: list[GroupLayout], new: GroupLayout, rank: int) -> list[Run]:
    """The runs of ``rank``'s partition of ``new`` (a group of this engine's layout) in the saved groups
    ``saved``, sorted by new offset, adjacent continuations merged. Parameters are matched by name (the
    caller has checked both layouts hold the same parameters and shapes)."""
    where = {p.name: (g, p) for g, group in enumerate(saved) for p in group.params}
    runs = []
    for p in new.params:
        g_saved, old = where[p.name]
        for c in p.pieces:
            if c.rank != rank:
                continue
            for s in old.pieces:
                a, b = max(c.param_offset, s.param_offset), min(c.param_offset + c.length, s.param_offset + s.length)
                if a < b:
                    runs.append(Run(c.part_offset + a - c.param_offset, b - a, s.rank, g_saved,
                                    s.part_offset + a - s.param_offset))
    runs.sort(key=lambda r: r.new_offset)
    merged: list[Run] = []
    for r in runs:
        last = merged[-1] if merged else None
        if last and (last.rank, last.group) == (r.rank, r.group) and last.new_offset + last.length == r.new_offset \
                and last.saved_offset + last.length == r.saved_offset:
            merged[-1] = Run(last.new_offset, last.length + r.length, r.rank, r.group, last.saved_offset)
        else:
            merged.append(r)
    return merged


def check_saved_partitions(directory: Path, manifest: dict) -> None:
    """Every saved rank file holds each group's partition of every kind in the manifest's size (read from the
    headers only).

    Raises:
        CheckpointError: a tensor missing or of another shape, naming the file.
    """
    for r in range(manifest["partitions"]):
        path = directory / rank_file(r)
        with safe_open(str(path), framework="pt") as f:
            check_rank_file(f, path, manifest["groups"])


def check_rank_file(handle, path: Path, groups: list[dict]) -> None:
    """One open rank file holds each of ``groups``' partitions of every kind in its manifest size.

    Raises:
        CheckpointError: a tensor missing or of another shape, naming the file.
    """
    for g, group in enumerate(groups):
        for kind in STATE_KINDS:
            saved_slice(handle, path, g, kind, group["partition_numel"])


def saved_slice(handle, path: Path, g: int, kind: str, numel: int):
    """The saved partition ``group{g}.{kind}`` of a rank file as a lazy slice, checked to hold ``numel``
    elements.

    Raises:
        CheckpointError: the tensor is missing or of another shape (naming the file).
    """
    key = f"group{g}.{kind}"
    if key not in handle.keys():
        raise CheckpointError(f"checkpoint file '{path}' lacks tensor '{key}'")
    piece = handle.get_slice(key)
    if list(piece.get_shape()) != [numel]:
        raise CheckpointError(f"checkpoint file '{path}' holds '{key}' of shape {piece.get_shape()}, its manifest "
                              f"says [{numel}]")
    return piece


def reshard_chunks(directory: Path, manifest: dict, runs: list[Run], numel: int,
                   chunk_numel: int = CHUNK_NUMEL) -> Iterator[StateChunk]:
    """Yield (offset, {kind: fp32 CPU tensor of at most ``chunk_numel`` elements}) covering [0, ``numel``) of
    the new partition in order: the runs' elements read from the saved rank files, zeros between them. The
    files are opened on the first piece and closed when the generator ends."""
    handles: dict[int, object] = {}
    slices: dict[tuple[int, int, str], object] = {}

    def piece(r: Run, lo: int, n: int) -> dict[str, torch.Tensor]:
        out = {}
        for kind in STATE_KINDS:
            key = (r.rank, r.group, kind)
            if key not in slices:
                if r.rank not in handles:
                    handles[r.rank] = safe_open(str(directory / rank_file(r.rank)), framework="pt")
                slices[key] = saved_slice(handles[r.rank], directory / rank_file(r.rank), r.group, kind,
                                          manifest["groups"][r.group]["partition_numel"])
            out[kind] = slices[key][r.saved_offset + lo:r.saved_offset + lo + n].float()
        return out

    def zeros(lo: int, hi: int) -> Iterator[StateChunk]:
        for a in range(lo, hi, chunk_numel):
            n = min(chunk_numel, hi - a)
            yield a, {kind: torch.zeros(n, dtype=torch.float32) for kind in STATE_KINDS}

    try:
        covered = 0
        for r in runs:
            yield from zeros(covered, r.new_offset)
            for lo in range(0, r.length, chunk_numel):
                yield r.new_offset + lo, piece(r, lo, min(chunk_numel, r.length - lo))
            covered = r.new_offset + r.length
        yield from zeros(covered, numel)
    finally:
        slices.clear()
        handles.clear()
