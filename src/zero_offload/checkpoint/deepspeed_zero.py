"""A DeepSpeed ZeRO checkpoint's optimizer partitions (``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``): where
each parameter's pieces lie in the rank files. Stages 1-2 lay each param group out flat (parameters in
``param_shapes`` order, each followed by its alignment padding) and cut it into equal partitions; stage 3 cuts every
parameter into ``ceil(numel / ranks)`` pieces, and rank R's flat partition (its sub-groups in order) is its piece of
each parameter in turn (``deepspeed/utils/zero_to_fp32.py``). Rank files are memory-mapped and read piece by piece.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from zero_offload.checkpoint.deepspeed_states import ModelStates, as_int, numel
from zero_offload.checkpoint.foreign_pickle import load_pt
from zero_offload.checkpoint.io import CheckpointError
from zero_offload.runtime.state import STATE_KINDS

__all__ = ["ZeroShards"]

_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class ZeroShards(ModelStates):
    """A DeepSpeed ZeRO checkpoint (stage 1, 2 or 3): where each parameter's pieces lie in the rank files."""

    def __init__(self, directory: Path):
        super().__init__(directory)
        files = {}
        for f in directory.iterdir():
            m = _OPTIM.match(f.name)
            if m:
                files[int(m.group(2))] = f
        if not files:
            raise CheckpointError(f"DeepSpeed checkpoint '{directory}' has no optimizer partition files "
                                  f"('zero_pp_rank_R_mp_rank_00_optim_states.pt'); a stage-0 or weights-only "
                                  f"checkpoint carries no ZeRO partitions to resume")
        self._files = files
        self._ranks: dict[int, dict] = {}
        self._momentum_offsets: dict[tuple[int, int], dict[str, tuple[int, int]]] = {}   # Muon, on the device
        first = self._rank(min(files))["osd"]
        self.stage = as_int(first["zero_stage"])
        count = first.get("partition_count", 1)
        self.world = max(as_int(c) for c in count) if isinstance(count, (list, tuple)) else as_int(count)
        for r in range(self.world):
            if r not in files:
                prefix = "bf16_" if files[min(files)].name.startswith("bf16_") else ""
                missing = directory / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                raise CheckpointError(f"checkpoint file '{missing}' is missing: the checkpoint was written by "
                                      f"{self.world} ranks")
        self.pieces = self._pieces_stage3() if self.stage == 3 else self._pieces_stage12()

    def _rank(self, r: int) -> dict:
        """Rank ``r``'s optimizer state (`_rank_state`), read once."""
        if r not in self._ranks:
            self._ranks[r] = _rank_state(self._files[r])
        return self._ranks[r]

    def _sizes(self) -> list[int]:
        """The flat partition sizes, checked equal on every rank."""
        sizes = [t.numel() for t in self._rank(0)["flats"]]
        for r in range(1, self.world):
            mine = [t.numel() for t in self._rank(r)["flats"]]
            if mine != sizes:
                raise CheckpointError(f"checkpoint file '{self._files[r]}' holds partitions of {mine} elements, "
                                      f"rank 0's file {sizes}: the files are from different runs or damaged")
        return sizes

    def _pieces_stage12(self) -> dict[str, list[tuple]]:
        """Stages 1-2 (`stage12_pieces`), checked against DeepSpeed's own per-rank slice mappings."""
        sizes = self._sizes()
        if len(sizes) != len(self.groups):
            raise CheckpointError(f"checkpoint file '{self._files[0]}' holds {len(sizes)} param groups, "
                                  f"'{self.model_file}' names {len(self.groups)}")
        paddings = self._rank(0)["osd"].get("param_alignment_paddings")
        pieces = stage12_pieces(self.groups, sizes, paddings, self.world, self.model_file)
        self._check_slice_mappings(pieces)
        return pieces

    def _check_slice_mappings(self, pieces: dict[str, list[tuple]]) -> None:
        for r in range(self.world):
            mappings = self._rank(r)["osd"].get("param_slice_mappings")
            for g, mapping in enumerate(mappings or []):
                for name, where in mapping.items():
                    start, count = int(where.state.get("start", -1)), int(where.state.get("numel", -1))
                    mine = [(p[2], p[3]) for p in pieces.get(name, []) if p[0] == r and p[1] == g]
                    if mine != [(start, count)]:
                        raise CheckpointError(f"checkpoint file '{self._files[r]}' places '{name}' at {start}+{count} "
                                              f"of its partition, the layout of '{self.model_file}' at {mine}: the "
                                              f"files are from different runs or damaged")

    def _pieces_stage3(self) -> dict[str, list[tuple]]:
        """Stage 3: every parameter cut into ceil(numel / ranks) pieces; rank r's flat partition (its sub-groups in
        order) holds its piece of each parameter in turn."""
        sizes = self._sizes()
        for r in range(self.world):
            groups = self._rank(r)["osd"].get("ds_zero_partition_groups") or []
            if any(int(g.get("partition_count", self.world)) != self.world for g in groups):
                raise CheckpointError(f"checkpoint file '{self._files[r]}' partitions some sub-groups over fewer "
                                      f"ranks (hpZ/MiCS), which this engine does not map")
        return stage3_pieces(self.shapes, sizes, self.world, self.model_file)

    def state_format(self) -> str:
        """``muon`` when some group holds DeepSpeed Muon's ``momentum_buffer``, else ``adam``."""
        return "muon" if any("momentum_buffer" in m for m in self._rank(0)["moments"]) else "adam"

    def step(self) -> int:
        """The Adam groups' step count (Muon's groups keep none; 0 when every group is Muon's)."""
        steps = {as_int(m["step"]) for r in range(self.world) for m in self._rank(r)["moments"] if "step" in m}
        if not steps and self.state_format() == "muon":
            return 0
        if len(steps) != 1:
            raise CheckpointError(f"DeepSpeed checkpoint '{self.directory}' holds step counts {sorted(steps)} "
                                  f"(one expected)")
        return steps.pop()

    def param_groups(self) -> list[dict]:
        """DeepSpeed's param groups (torch's keys), without their ``params``."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self._rank(0)["groups"]]

    def loss_scaler(self) -> Any:
        return self._rank(0)["osd"].get("loss_scaler")

    def read(self, name: str, shape: tuple) -> dict:
        n = numel(shape)
        out = {k: torch.zeros(n) for k in STATE_KINDS}
        for r, g, lo, length, at in self.pieces[name]:
            state = self._rank(r)
            moments = state["moments"][g]
            if "momentum_buffer" in moments:      # DeepSpeed Muon: the momentum, and no second moment
                buffer = moments["momentum_buffer"]
                whole = buffer.numel() != state["flats"][g].numel()
                out["master"][at:at + length] = state["flats"][g][lo:lo + length]
                out["exp_avg"][at:at + length] = (self._whole_momentum(r, g, name, buffer)[at:at + length] if whole
                                                  else buffer[lo:lo + length])
                continue
            sources = {"master": state["flats"][g], "exp_avg": moments["exp_avg"], "exp_avg_sq": moments["exp_avg_sq"]}
            for k in STATE_KINDS:
                out[k][at:at + length] = sources[k][lo:lo + length]
        return out

    def _whole_momentum(self, r: int, g: int, name: str, buffer: torch.Tensor) -> torch.Tensor:
        """``name``'s whole momentum in DeepSpeed Muon's buffer of whole parameters (optimizer on the device:
        ``_muon_momentum_buffer``, each parameter with a piece in rank ``r``'s partition of group ``g``, in order);
        with the optimizer offloaded the buffer is partition-sized (``_apply_muon_updates_cpu_offload``)."""
        if (r, g) not in self._momentum_offsets:
            held = sorted((lo, n) for n, pieces in self.pieces.items()
                          for rr, gg, lo, _, _ in pieces if (rr, gg) == (r, g))
            offsets, at = {}, 0
            for _, n in held:
                offsets[n] = (at, numel(self.shapes[n]))
                at += offsets[n][1]
            self._momentum_offsets[r, g] = offsets
        if name not in self._momentum_offsets[r, g]:
            raise CheckpointError(f"checkpoint file '{self._files[r]}' has no momentum for '{name}'")
        offset, size = self._momentum_offsets[r, g][name]
        return buffer[offset:offset + size]

    def module_state(self) -> dict[str, torch.Tensor]:
        out = super().module_state()
        if self.stage == 3:
            out.update(self._frozen_stage3())
        return out

    def _frozen_stage3(self) -> dict[str, torch.Tensor]:
        """Stage-3 frozen parameters: each rank's model states file holds its fragment."""
        shapes = self.model.get("frozen_param_shapes") or {}
        if not shapes:
            return {}
        fragments = []
        for r in range(self.world):
            path = self.directory / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            fragments.append((load_pt(path).get("frozen_param_fragments") or {}, path))
        out = {}
        for name, shape in shapes.items():
            if any(name not in f for f, _ in fragments):
                path = next(p for f, p in fragments if name not in f)
                raise CheckpointError(f"checkpoint file '{path}' lacks its fragment of frozen parameter '{name}'")
            flat = torch.cat([f[name].reshape(-1) for f, _ in fragments])
            out[name] = flat[:numel(shape)].view(tuple(shape))
        return out


def _split(offset: int, length: int, starts: list[int], sizes: list[int]):
    """A run of a rank's flat partition as (sub-group, offset in it, length, elements before it) pieces."""
    done = 0
    for g, (start, size) in enumerate(zip(starts, sizes)):
        lo, hi = max(offset + done, start), min(offset + length, start + size)
        if lo < hi:
            yield g, lo - start, hi - lo, lo - offset
            done = hi - offset

def _rank_state(path: Path) -> dict:
    """A rank file's optimizer state, memory-mapped: {"osd": DeepSpeed's optimizer state dict, "flats": [flat fp32
    master partition per group or sub-group], "moments": [{"exp_avg", "exp_avg_sq", "step"}], "groups": the param
    groups}, checked for Adam's moments of the masters' sizes."""
    sd = load_pt(path)
    osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
    if not isinstance(osd, dict) or "zero_stage" not in osd:
        raise CheckpointError(f"checkpoint file '{path}' is not a DeepSpeed ZeRO optimizer partition")
    stage = as_int(osd["zero_stage"])
    base = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state") or {}
    flats = osd.get("fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups")
    states = base.get("state", {})
    if not isinstance(flats, list) or not all(torch.is_tensor(t) for t in flats):
        raise CheckpointError(f"checkpoint file '{path}' holds no fp32 master partitions")
    for i, flat in enumerate(flats):
        state = states.get(i, {})
        if "momentum_buffer" in state and "exp_avg" not in state:     # a DeepSpeed Muon group (stages 1-2)
            if stage == 3:
                raise CheckpointError(f"checkpoint file '{path}' holds a stage-3 Muon group {i}, whose momentum "
                                      f"DeepSpeed keeps apart from the checkpoint's partitions; stages 1-2 map")
            continue
        if not {"exp_avg", "exp_avg_sq"} <= set(state):
            optimizer = ((sd.get("ds_config") or {}).get("optimizer") or {}).get("type", "unknown")
            raise CheckpointError(f"checkpoint file '{path}' holds optimizer state {sorted(state)} for group {i} "
                                  f"(DeepSpeed optimizer '{optimizer}'); only Adam's moments and Muon's momentum "
                                  f"map onto this engine")
        for kind in ("exp_avg", "exp_avg_sq"):
            if state[kind].numel() != flat.numel():
                raise CheckpointError(f"checkpoint file '{path}' is damaged: group {i}'s {kind} has "
                                      f"{state[kind].numel()} elements, its master weights {flat.numel()}")
    return {"osd": osd, "flats": flats, "moments": [states[i] for i in range(len(flats))],
            "groups": base.get("param_groups", [])}


Pieces = dict[str, list[tuple[int, int, int, int, int]]]
"""{parameter name: [(rank, flat partition, offset in it, length, offset in the parameter)]}."""


def stage12_pieces(groups: list[dict], sizes: list[int], paddings, world: int, model_file: Path) -> Pieces:
    """Stages 1-2: group g flat over all ranks (rank r holds [r*P, (r+1)*P) of it, P = ``sizes[g]``), its
    parameters (``groups[g]``: {name: shape}) in order, each followed by its alignment padding (``paddings[g][i]``;
    DeepSpeed's ``param_alignment_paddings``, None for none)."""
    pieces: Pieces = {}
    for g, (shapes, size) in enumerate(zip(groups, sizes)):
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = numel(shape)
            pieces[name] = [(r, g, lo - r * size, hi - lo, lo - offset)
                            for r in range(offset // size if size else 0, world)
                            for lo, hi in [(max(offset, r * size), min(offset + n, (r + 1) * size))] if lo < hi]
            offset += n + (int(paddings[g][i]) if paddings else 0)
        if offset > size * world:
            raise CheckpointError(f"checkpoint file '{model_file}' names {offset} elements for param group {g}, "
                                  f"the {world} partitions hold {size * world}")
    return pieces


def stage3_pieces(shapes: dict[str, tuple], sizes: list[int], world: int, model_file: Path) -> Pieces:
    """Stage 3: every parameter (``shapes``, in order) cut into ceil(numel / ranks) pieces; rank r's flat partition,
    its sub-groups (of ``sizes``) in order, holds its piece of each parameter in turn."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces: Pieces = {}
    offset = 0
    for name, shape in shapes.items():
        n = numel(shape)
        part = math.ceil(n / world)
        pieces[name] = []
        for r in range(world):
            length = max(0, min(part, n - r * part))
            pieces[name] += [(r, g, lo, ln, r * part + done) for g, lo, ln, done in _split(offset, length, starts,
                                                                                             sizes)]
        offset += part
    if offset != sum(sizes):
        raise CheckpointError(f"checkpoint file '{model_file}' names parameters of {offset} elements per rank, the "
                              f"partitions hold {sum(sizes)}")
    return pieces
