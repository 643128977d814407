"""A warning when ``sequence_parallel_size`` splits the sequences but the model's attention is not Ulysses': each rank
would then attend within its own shard only, and train something else than the model on whole sequences.

What can be told: a Hugging Face model whose attention implementation `register_with_transformers` wrapped, and a
model whose ``attend`` cores `make_sequence_parallel` wrapped (zero-offload's GPT). Any other model cannot be told
apart from one that does its own sequence parallelism, so it gets no warning.
"""
from __future__ import annotations

import warnings

import torch

from zero_offload.sequence import groups as sequence_groups
from zero_offload.sequence.gpt import UlyssesCore
from zero_offload.sequence.hf_registration import registered

__all__ = ["warn_if_not_sequence_parallel", "groups_for"]


def _wrapped(model: torch.nn.Module) -> bool | None:
    """True: Ulysses wraps the model's attention; False: it could and does not; None: cannot tell."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if isinstance(impl, str):
        return impl in registered()
    cores = [m.attend for m in model.modules() if callable(getattr(m, "attend", None))]
    if cores:
        return all(isinstance(c, UlyssesCore) for c in cores)
    return None


def warn_if_not_sequence_parallel(model: torch.nn.Module, size: int) -> None:
    """Warn (``UserWarning``, naming the key and the size) when ``size`` > 1 and the model's attention is known not to
    be sequence parallel."""
    if size > 1 and _wrapped(model) is False:
        warnings.warn(f"config key 'sequence_parallel_size' = {size}, but the model's attention is not sequence "
                      f"parallel: each rank would attend within its own shard only. Register Ulysses first "
                      f"(UlyssesSPAttentionHF.register_with_transformers before from_pretrained, or "
                      f"zero_offload.sequence.gpt.make_sequence_parallel)", stacklevel=4)


def groups_for(model: torch.nn.Module, size: int) -> sequence_groups.SequenceParallelGroups:
    """The engine's groups for ``sequence_parallel_size`` ``size`` (`groups.initialize`), with the warning above."""
    made = sequence_groups.initialize(size)
    warn_if_not_sequence_parallel(model, made.size)
    return made
