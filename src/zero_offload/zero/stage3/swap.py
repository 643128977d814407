"""Replacing a parameter's tensor in place while the Parameter object (and so ties and references) stays."""
from __future__ import annotations

import torch

__all__ = ["swap_keeping_attributes"]


def swap_keeping_attributes(p: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
    """``torch.utils.swap_tensors(p, new)``, keeping the attributes code set on ``p``: swap_tensors swaps the
    objects' ``__dict__`` too, and a flag a library set on the parameter must survive it (transformers marks each
    loaded parameter ``_is_hf_initialized`` inside ``GatheredParameters`` and re-initialises the unmarked ones).

    Raises:
        RuntimeError: as swap_tensors (a weak reference to ``p`` or ``new``).
    """
    kept = dict(p.__dict__)
    torch.utils.swap_tensors(p, new)
    p.__dict__.update(kept)
