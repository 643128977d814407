"""Resume from a DeepSpeed checkpoint (issue 30, item 1): a ZeRO checkpoint as DeepSpeed 0.19 writes it at stage
1, 2 or 3, or a universal checkpoint (``ds_to_universal.py``'s output), into any ZeRO stage and world size here.

A ZeRO checkpoint (``save_dir/tag/``):
  ``mp_rank_00_model_states.pt``            stages 1-2: the module's state dict (16-bit), ``param_shapes`` (one
                                            ordered {name: shape} per param group), the LR schedule, counters
                                            and the user's ``client_state`` keys;
  ``zero_pp_rank_R_mp_rank_00_model_states.pt``  stage 3: the same per rank, parameters empty, frozen
                                            parameters as per-rank fragments;
  ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``  rank R's partition: fp32 master weights
                                            (``single_partition_of_fp32_groups`` at stages 1-2,
                                            ``fp32_flat_groups`` per sub-group at stage 3), Adam's moments of the
                                            same flat partitions, the step, the loss scaler, the param groups.
Stages 1-2 lay each param group out flat (parameters in ``param_shapes`` order, each followed by its alignment
padding) and cut it into equal partitions; stage 3 cuts every parameter into ``ceil(numel / ranks)`` pieces, and
rank R's flat partition is its piece of every parameter in order (``deepspeed/utils/zero_to_fp32.py``). A
universal checkpoint holds each parameter whole: ``tag/zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt`` and
``step.pt``, with ``tag/zero/optimizer_state.pt`` for the loss scaler and param groups.

`load_deepspeed` reads, on each rank, only the parameters its partitions hold pieces of, one at a time; the rank
files are memory-mapped, so nothing beyond one parameter's state is held. Everything is checked on every rank
before the engine changes: the layout against each rank file (sizes, DeepSpeed's own slice mappings), the
parameters against the model (the first one missing or shaped otherwise is named), the optimizer (Adam's
moments), and what cannot be mapped (tensor or pipeline parallelism, MoE experts, NVMe-offloaded optimizer
state) is refused naming the file and the reason. The files are read with `foreign_pickle.load_pt`: DeepSpeed
need not be installed, and no code in the files runs.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from zero_offload.checkpoint.foreign import ForeignState, apply_foreign, check_parameters, module_values
from zero_offload.checkpoint.foreign_pickle import Foreign, load_pt
from zero_offload.checkpoint.io import CheckpointError, agree
from zero_offload.checkpoint.manifest import check_tag
from zero_offload.state import STATE_KINDS, CheckpointTarget

__all__ = ["find_deepspeed", "load_deepspeed", "read_deepspeed"]

MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_FILE_KIND = {"master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
# The keys DeepSpeed writes into the model states file itself; the rest is the user's client_state.
_OWN_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
             "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
             "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
             "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info", "ds_autoep_layers"}


def find_deepspeed(load_dir: str | os.PathLike, tag: str | None = None) -> Path | None:
    """The tag directory of the DeepSpeed checkpoint at ``load_dir`` (``tag``, else the one ``latest`` or
    ``latest_universal`` names; ``load_dir`` itself when it is a tag directory), or None when there is none."""
    root = Path(load_dir)
    if tag is None and _is_tag_dir(root):
        return root
    if tag is None:
        for pointer in ("latest", "latest_universal"):
            if (root / pointer).is_file():
                tag = check_tag((root / pointer).read_text().strip(), f"'{root / pointer}'")
                break
    return root / tag if tag is not None and _is_tag_dir(root / tag) else None


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("*model_states.pt")) or (path / "zero" / "optimizer_state.pt").is_file())


def _int(value: Any) -> int:
    """An int from DeepSpeed's ints, 0-d tensors and enums (`Foreign` records of ``ZeroStageEnum``)."""
    if isinstance(value, Foreign):
        value = value.args[0]
    return int(value.item() if torch.is_tensor(value) else value)


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


class _Checkpoint:
    """What both layouts share: the model states file, the refusals, and the engine's small state."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._refuse_unmappable()
        model_files = sorted(directory.glob("*model_states.pt"))
        if not model_files:
            raise CheckpointError(f"DeepSpeed checkpoint '{directory}' has no model states file "
                                  f"('{MODEL_STATES}' or 'zero_pp_rank_0_mp_rank_00_model_states.pt')")
        first = directory / MODEL_STATES if (directory / MODEL_STATES).is_file() else model_files[0]
        self.model_file = first
        self.model = load_pt(first)
        if not isinstance(self.model, dict) or "param_shapes" not in self.model:
            raise CheckpointError(f"checkpoint file '{first}' is not a DeepSpeed model states file (no "
                                  f"'param_shapes')")
        dims = self.model.get("checkpoint_parallel_dimensions") or {}
        if int(self.model.get("mp_world_size", 1)) > 1 or int(dims.get("tp_degree", 1)) > 1:
            raise CheckpointError(f"checkpoint file '{first}' was written with tensor parallelism (degree "
                                  f"{max(int(self.model.get('mp_world_size', 1)), int(dims.get('tp_degree', 1)))}), "
                                  f"which this engine does not map; convert it with DeepSpeed's ds_to_universal "
                                  f"on a tensor-parallel model first")
        if int(dims.get("pp_degree", 1)) > 1:
            raise CheckpointError(f"checkpoint file '{first}' was written with pipeline parallelism, which this "
                                  f"engine does not map")
        if "num_experts" in self.model or self.model.get("ds_autoep_layers"):
            raise CheckpointError(f"checkpoint file '{first}' holds MoE expert-parallel layers, which this engine "
                                  f"does not map")
        shapes = self.model["param_shapes"]
        if not shapes:
            raise CheckpointError(f"checkpoint file '{first}' was written without ZeRO (stage 0: no partitions, "
                                  f"no 'param_shapes'), which this reader does not map; resume it in DeepSpeed at "
                                  f"ZeRO stage 1-3 and save again")
        groups = shapes if isinstance(shapes, list) else [shapes]
        self.groups = [{name: tuple(int(d) for d in shape) for name, shape in g.items()} for g in groups]
        self.shapes = {name: shape for g in self.groups for name, shape in g.items()}

    def _refuse_unmappable(self) -> None:
        d = self.directory
        for pattern, why in (("layer_*", "pipeline-parallel layer files"), ("*expert_*", "MoE expert files"),
                             ("mp_rank_01_*", "tensor-parallel rank files"),
                             ("*_mp_rank_01_*", "tensor-parallel rank files")):
            found = sorted(d.glob(pattern))
            if found:
                raise CheckpointError(f"DeepSpeed checkpoint '{d}' holds {why} ('{found[0].name}'), which this "
                                      f"engine does not map")
        if (d / "offloaded_tensors").is_dir():
            raise CheckpointError(f"DeepSpeed checkpoint '{d}' keeps its optimizer state in NVMe swap files "
                                  f"('{d / 'offloaded_tensors'}'); resume it in DeepSpeed and save it without NVMe "
                                  f"offload, or convert it with ds_to_universal")

    def module_state(self) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters (full tensors), by name."""
        module = self.model.get("module") or {}
        names = set(self.model.get("buffer_names") or ()) | set(self.model.get("frozen_param_shapes") or {})
        return {n: t for n, t in module.items() if n in names and torch.is_tensor(t) and t.numel() > 0}

    def named_groups(self) -> list[tuple[dict, list[str]]]:
        """(hyperparameters, parameter names) per param group. At stage 3 ``param_shapes`` lists sub-groups: they
        map onto the param groups one to one when there are as many (DeepSpeed cuts a group into several only
        beyond ``sub_group_size``), and all into one group when the groups' hyperparameters are the same.

        Raises:
            CheckpointError: neither holds, so which parameters each group holds is unknown.
        """
        hparams = self.param_groups()
        names = [list(g) for g in self.groups]
        if len(hparams) == len(names):
            return list(zip(hparams, names))
        if all(h == hparams[0] for h in hparams):
            return [(hparams[0], [n for g in names for n in g])]
        raise CheckpointError(f"checkpoint file '{self.model_file}' lists {len(names)} parameter sub-groups for "
                              f"{len(hparams)} param groups with different hyperparameters: which parameters each "
                              f"group holds is not recorded")

    def engine_state(self, engine: CheckpointTarget, lrs: list[float], loss_scaler: Any,
                     lr_scheduler: bool) -> dict:
        """Overrides of ``engine.state_dict()``: counters, learning rates, loss scaler, LR schedule (DeepSpeed's
        schedules keep ``last_batch_iteration``, as ours do)."""
        out = {"global_step": int(self.model.get("global_steps", 0)),
               "skipped_steps": int(self.model.get("skipped_steps", 0))}
        if len(lrs) == len(engine.state_dict()["lrs"]):
            out["lrs"] = [float(lr) for lr in lrs]
        scaler = _loss_scaler(loss_scaler, engine.state_dict()["loss_scaler"])
        if scaler is not None:
            out["loss_scaler"] = scaler
        saved = self.model.get("lr_scheduler")
        if lr_scheduler and engine.state_dict()["lr_scheduler"] is not None and isinstance(saved, dict):
            if "last_batch_iteration" not in saved:
                raise CheckpointError(f"checkpoint file '{self.model_file}' holds an LR schedule of another kind "
                                      f"(keys {sorted(saved)}) than this engine's DeepSpeed-style schedule")
            out["lr_scheduler"] = {**engine.state_dict()["lr_scheduler"],
                                   "last_batch_iteration": int(saved["last_batch_iteration"])}
        return out

    def client_state(self) -> dict:
        return {k: v for k, v in self.model.items() if k not in _OWN_KEYS}


def _loss_scaler(saved: Any, mine: dict) -> dict | None:
    """Our loss scaler state from DeepSpeed's ``DynamicLossScaler`` (None for a static one: fp32 and bf16)."""
    if not isinstance(saved, Foreign) or not saved.state.get("dynamic"):
        return None
    s = saved.state
    return {**mine, "scale": float(s["cur_scale"]), "hysteresis": int(s.get("cur_hysteresis", mine["hysteresis"])),
            "iteration": int(s.get("cur_iter", 0)), "last_overflow_iteration": int(s.get("last_overflow_iter", -1))}


class ZeroShards(_Checkpoint):
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
        first = self._rank(min(files))["osd"]
        self.stage = _int(first["zero_stage"])
        count = first.get("partition_count", 1)
        self.world = max(_int(c) for c in count) if isinstance(count, (list, tuple)) else _int(count)
        for r in range(self.world):
            if r not in files:
                prefix = "bf16_" if files[min(files)].name.startswith("bf16_") else ""
                missing = directory / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                raise CheckpointError(f"checkpoint file '{missing}' is missing: the checkpoint was written by "
                                      f"{self.world} ranks")
        self.pieces = self._pieces_stage3() if self.stage == 3 else self._pieces_stage12()

    def _rank(self, r: int) -> dict:
        """Rank ``r``'s optimizer state, memory-mapped: {"flats": [flat fp32], "moments": [{kind: flat}], ...}."""
        if r not in self._ranks:
            path = self._files[r]
            sd = load_pt(path)
            osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
            if not isinstance(osd, dict) or "zero_stage" not in osd:
                raise CheckpointError(f"checkpoint file '{path}' is not a DeepSpeed ZeRO optimizer partition")
            stage = _int(osd["zero_stage"])
            base = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state") or {}
            flats = osd.get("fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups")
            states = base.get("state", {})
            if not isinstance(flats, list) or not all(torch.is_tensor(t) for t in flats):
                raise CheckpointError(f"checkpoint file '{path}' holds no fp32 master partitions")
            for i, flat in enumerate(flats):
                state = states.get(i, {})
                if not {"exp_avg", "exp_avg_sq"} <= set(state):
                    optimizer = ((sd.get("ds_config") or {}).get("optimizer") or {}).get("type", "unknown")
                    raise CheckpointError(f"checkpoint file '{path}' holds optimizer state {sorted(state)} for group "
                                          f"{i} (DeepSpeed optimizer '{optimizer}'); only Adam's moments map onto "
                                          f"this engine")
                for kind in ("exp_avg", "exp_avg_sq"):
                    if state[kind].numel() != flat.numel():
                        raise CheckpointError(f"checkpoint file '{path}' is damaged: group {i}'s {kind} has "
                                              f"{state[kind].numel()} elements, its master weights {flat.numel()}")
            self._ranks[r] = {"osd": osd, "flats": flats, "moments": [states[i] for i in range(len(flats))],
                              "groups": base.get("param_groups", []), "path": path}
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
        """Stages 1-2: group g flat over all ranks (rank r holds [r*P, (r+1)*P)); parameters in order, each followed
        by its alignment padding. Checked against DeepSpeed's own per-rank slice mappings where present."""
        sizes = self._sizes()
        if len(sizes) != len(self.groups):
            raise CheckpointError(f"checkpoint file '{self._files[0]}' holds {len(sizes)} param groups, "
                                  f"'{self.model_file}' names {len(self.groups)}")
        paddings = self._rank(0)["osd"].get("param_alignment_paddings")
        pieces: dict[str, list[tuple]] = {}
        for g, (shapes, size) in enumerate(zip(self.groups, sizes)):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = _numel(shape)
                pieces[name] = [(r, g, lo - r * size, hi - lo, lo - offset)
                                for r in range(offset // size if size else 0, self.world)
                                for lo, hi in [(max(offset, r * size), min(offset + n, (r + 1) * size))] if lo < hi]
                offset += n + (int(paddings[g][i]) if paddings else 0)
            if offset > size * self.world:
                raise CheckpointError(f"checkpoint file '{self.model_file}' names {offset} elements for param group "
                                      f"{g}, the {self.world} partitions hold {size * self.world}")
        self._check_slice_mappings(pieces)
        return pieces

    def _check_slice_mappings(self, pieces: dict[str, list[tuple]]) -> None:
        for r in range(self.world):
            mappings = self._rank(r)["osd"].get("param_slice_mappings")
            for g, mapping in enumerate(mappings or []):
                for name, where in mapping.items():
                    start, numel = int(where.state.get("start", -1)), int(where.state.get("numel", -1))
                    mine = [(p[2], p[3]) for p in pieces.get(name, []) if p[0] == r and p[1] == g]
                    if mine != [(start, numel)]:
                        raise CheckpointError(f"checkpoint file '{self._files[r]}' places '{name}' at {start}+{numel} "
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
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        pieces: dict[str, list[tuple]] = {}
        offset = 0
        for name, shape in self.shapes.items():
            n = _numel(shape)
            part = math.ceil(n / self.world)
            pieces[name] = []
            for r in range(self.world):
                length = max(0, min(part, n - r * part))
                pieces[name] += [(r, g, lo, ln, r * part + done) for g, lo, ln, done in _split(offset, length, starts,
                                                                                                 sizes)]
            offset += part
        if offset != sum(sizes):
            raise CheckpointError(f"checkpoint file '{self.model_file}' names parameters of {offset} elements per "
                                  f"rank, the partitions in '{self._files[0]}' hold {sum(sizes)}")
        return pieces

    def step(self) -> int:
        steps = {_int(m["step"]) for r in range(self.world) for m in self._rank(r)["moments"] if "step" in m}
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
        n = _numel(shape)
        out = {k: torch.zeros(n) for k in STATE_KINDS}
        for r, g, lo, length, at in self.pieces[name]:
            state = self._rank(r)
            sources = {"master": state["flats"][g], "exp_avg": state["moments"][g]["exp_avg"],
                       "exp_avg_sq": state["moments"][g]["exp_avg_sq"]}
            for k in STATE_KINDS:
                out[k][at:at + length] = sources[k][lo:lo + length]
        return out

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
            out[name] = flat[:_numel(shape)].view(tuple(shape))
        return out


def _split(offset: int, length: int, starts: list[int], sizes: list[int]):
    """A run of a rank's flat partition as (sub-group, offset in it, length, elements before it) pieces."""
    done = 0
    for g, (start, size) in enumerate(zip(starts, sizes)):
        lo, hi = max(offset + done, start), min(offset + length, start + size)
        if lo < hi:
            yield g, lo - start, hi - lo, lo - offset
            done = hi - offset


class UniversalFiles(_Checkpoint):
    """A DeepSpeed universal checkpoint: each parameter whole in ``zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt``."""

    def __init__(self, directory: Path):
        super().__init__(directory)
        self.stage = None
        self.optim = load_pt(directory / "zero" / "optimizer_state.pt")
        if not isinstance(self.optim, dict):
            raise CheckpointError(f"checkpoint file '{directory / 'zero' / 'optimizer_state.pt'}' is not DeepSpeed's "
                                  f"optimizer state")

    def _file(self, name: str, kind: str) -> Path:
        return self.directory / "zero" / name / f"{kind}.pt"

    def check(self, names: list[str]) -> None:
        """Each of these parameters' files is present, readable and of its parameter's size."""
        for name in names:
            for kind in _FILE_KIND.values():
                self._tensor(name, kind)

    def _tensor(self, name: str, kind: str) -> torch.Tensor:
        path = self._file(name, kind)
        saved = load_pt(path)
        t = saved.get("param") if isinstance(saved, dict) else saved
        if not torch.is_tensor(t) or t.numel() != _numel(self.shapes[name]):
            raise CheckpointError(f"checkpoint file '{path}' holds {tuple(t.shape) if torch.is_tensor(t) else t!r}, "
                                  f"not parameter '{name}' of shape {self.shapes[name]}")
        return t

    def step(self) -> int:
        steps = set()
        for name in self.shapes:
            if self._file(name, "step").is_file():
                steps.add(_int(load_pt(self._file(name, "step"))))
        state = (self.optim.get("optimizer_state_dict") or {}).get("state") or {}
        steps.update(_int(s["step"]) for s in state.values() if isinstance(s, dict) and "step" in s)
        if len(steps) != 1:
            raise CheckpointError(f"DeepSpeed universal checkpoint '{self.directory}' holds step counts "
                                  f"{sorted(steps)} (one expected)")
        return steps.pop()

    def param_groups(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optim.get("param_groups", [])]


    def loss_scaler(self) -> Any:
        return self.optim.get("loss_scaler")

    def read(self, name: str, shape: tuple) -> dict:
        return {k: self._tensor(name, f).reshape(-1).float() for k, f in _FILE_KIND.items()}


def read_deepspeed(directory: Path) -> ZeroShards | UniversalFiles:
    """The reader of the DeepSpeed checkpoint in tag directory ``directory`` (its layout recognised)."""
    if (directory / "zero" / "optimizer_state.pt").is_file():
        return UniversalFiles(directory)
    return ZeroShards(directory)


def load_deepspeed(engine: CheckpointTarget, directory: str | os.PathLike, load_optimizer_states: bool = True,
                   load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> Any:
    """Load the DeepSpeed checkpoint in tag directory ``directory`` into ``engine`` (see the module docstring);
    returns its ``client_state`` (the keys the user passed to DeepSpeed's ``save_checkpoint``). A collective.

    The flags mirror DeepSpeed's ``load_checkpoint``: without ``load_optimizer_states`` the moments start at zero
    and the step at 0; without ``load_lr_scheduler_states`` the engine keeps its schedule; ``load_module_only``
    loads the weights alone (as master weights) and leaves counters, schedule and loss scale as they are.

    Raises:
        CheckpointError: a missing, truncated or damaged file (named), a checkpoint of another model (the first
            parameter that differs named), an optimizer other than Adam, or what cannot be mapped (tensor or
            pipeline parallelism, MoE, NVMe-offloaded state). Nothing in the engine is changed then.
    """
    directory = Path(directory)
    error, reader, state = None, None, None
    try:
        if engine.optimizer_state.state_format() != "adam":
            raise CheckpointError(f"checkpoint '{directory}': a DeepSpeed checkpoint of Adam's states cannot be loaded "
                                  f"into an engine whose optimizer keeps {engine.optimizer_state.state_format()!r}")
        reader = read_deepspeed(directory)
        check_parameters(engine, reader.shapes, f"'{reader.model_file}'")
        mine = [p.name for g in engine.optimizer_state.layout() for p in g.params]
        if isinstance(reader, UniversalFiles):
            reader.check(mine)
        full = load_optimizer_states and not load_module_only
        state = ForeignState(step=reader.step() if full else 0,
                             module=module_values(engine, reader.module_state(), f"'{reader.model_file}'"),
                             client_state=reader.client_state())
        if not load_module_only:
            lrs = [g["lr"] for g in reader.param_groups()] if full else []
            state.engine = reader.engine_state(engine, lrs, reader.loss_scaler(),
                                               load_lr_scheduler_states)
    except CheckpointError as e:
        error = e
    agree(engine, error, "loading the DeepSpeed checkpoint")
    read = reader.read if load_optimizer_states and not load_module_only else _weights_only(reader.read)
    return apply_foreign(engine, read, state)


def _weights_only(read):
    def weights(name: str, shape: tuple) -> dict:
        master = read(name, shape)["master"]
        return {"master": master, "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
    return weights
