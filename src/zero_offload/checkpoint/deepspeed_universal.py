"""A DeepSpeed universal checkpoint (``ds_to_universal.py``'s output): each parameter whole in
``tag/zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt`` (``{"param": tensor, ...}``, or a flat tensor at stage 3) and
``step.pt``, with ``tag/zero/optimizer_state.pt`` for the loss scaler and param groups.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zero_offload.checkpoint.deepspeed_states import ModelStates, as_int, numel
from zero_offload.checkpoint.foreign_pickle import load_pt
from zero_offload.checkpoint.io import CheckpointError

__all__ = ["UniversalFiles"]

_FILE_KIND = {"master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


class UniversalFiles(ModelStates):
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
        if not torch.is_tensor(t) or t.numel() != numel(self.shapes[name]):
            raise CheckpointError(f"checkpoint file '{path}' holds {tuple(t.shape) if torch.is_tensor(t) else t!r}, "
                                  f"not parameter '{name}' of shape {self.shapes[name]}")
        return t

    def state_format(self) -> str:
        """Adam's moments (a universal checkpoint of another optimizer is refused when read)."""
        return "adam"

    def step(self) -> int:
        steps = set()
        for name in self.shapes:
            if self._file(name, "step").is_file():
                steps.add(as_int(load_pt(self._file(name, "step"))))
        state = (self.optim.get("optimizer_state_dict") or {}).get("state") or {}
        steps.update(as_int(s["step"]) for s in state.values() if isinstance(s, dict) and "step" in s)
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
