"""`NoStep`: the partition optimizer of a model with nothing to train (a frozen reference model at stage 3), a
null object in the `PartitionOptimizer` role, so the memory accounting and `close` of its holder work unchanged."""
from __future__ import annotations

import torch

__all__ = ["NoStep"]


class NoStep:
    """No parameter groups: nothing is stepped, nothing is held."""

    masters: list[torch.Tensor] = []
    optimizer = None
    on_host = False
    host_thread = None
    speculation = None

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {}

    def staging_tensors(self) -> list[torch.Tensor]:
        return []

    def incoming_tensors(self) -> list[torch.Tensor]:
        return []

    def swapped_bytes(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        return None

    def discard_speculation(self) -> None:
        return None

    def step(self, *args, **kwargs) -> None:
        raise RuntimeError("a model with no trainable parameters has no optimizer step")
