"""Writing a DCP directory without holding it: `save_dcp`'s planner, which reads each tensor only when DCP writes
it, and the saved buffers and frozen parameters read one at a time.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from zero_offload.checkpoint.io import MODULE_STATE

__all__ = ["StreamingPlanner", "ModuleFile"]


class StreamingPlanner(DefaultSavePlanner):
    """DCP's save planner over a state dict of meta tensors (shapes only): each tensor named in ``fetch``
    ({flattened key: function returning it}) is read when DCP writes it, and dropped after. With one file per
    tensor (``single_file_per_rank=False``) the writer keeps nothing of the file before it once it is written."""

    def __init__(self, fetch: dict):
        super().__init__()
        self._fetch = fetch

    def resolve_data(self, write_item):
        fetch = self._fetch.get(write_item.index.fqn)
        return super().resolve_data(write_item) if fetch is None else fetch()


class ModuleFile:
    """The saved buffers and frozen parameters (our module state file), one at a time, floating ones as fp32."""

    def __init__(self, directory: Path, manifest: dict):
        self._file = safe_open(str(directory / MODULE_STATE), framework="pt") \
            if MODULE_STATE in manifest["files"] else None
        self.names = set(self._file.keys()) if self._file is not None else set()

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor of ``read(name)``'s shape and dtype."""
        saved = self._file.get_slice(name)
        floating = saved.get_dtype() in ("F16", "BF16", "F32", "F64")
        return torch.empty(saved.get_shape(), device="meta",
                           dtype=torch.float32 if floating else self.read(name).dtype)    # small integer buffers

    def read(self, name: str) -> torch.Tensor:
        t = self._file.get_tensor(name)
        return t.float() if t.is_floating_point() else t

    def __enter__(self) -> "ModuleFile":
        return self

    def __exit__(self, *exc) -> None:
        self._file = None
