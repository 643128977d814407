"""User-facing stage-3 helpers: building a model already sharded, and reading parameters outside forward."""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from zero_offload.zero.stage3 import registry
from zero_offload.zero.stage3.optimizer import ParamFacts
from zero_offload.zero.stage3.sharded_init import ShardedInit, close_full, has_slice, open_full, slice_bounds

__all__ = ["init_sharded", "gathered_parameters", "register_external_parameter", "param_facts"]


def init_sharded(config=None) -> ShardedInit:
    """Build a model inside this context and no rank ever holds a full copy of it.

    As each module's ``__init__`` returns, its parameters keep only this rank's 1/N slice of the values the
    constructor set and become meta tensors (`sharded_init`); `zero_offload.initialize` with ZeRO stage 3 then
    assembles each unit from the slices, module by module. The initial weights are bit-identical to a normal build
    with the same seed, writes a parent's ``__init__`` makes into its sharded children (Hugging Face's
    ``post_init``) included, as under DeepSpeed's ``zero.Init``. A parameter with no constructor values (created on
    the meta device) is initialised by ``param_init_fn(module)`` (an argument of ``initialize``; given, it runs on
    every module) or the module's ``reset_parameters()``. ``config`` is accepted for symmetry with
    ``deepspeed.zero.Init(config_dict_or_path=...)`` and unused.

    Example::

        with zero_offload.init_sharded():
            model = GPT(cfg)
        engine = zero_offload.initialize(model, config)
    """
    return ShardedInit()


@contextlib.contextmanager
def gathered_parameters(params: Iterable[torch.nn.Parameter] | torch.nn.Parameter,
                        modifier_rank: int | None = None, enabled: bool = True):
    """Gather stage-3 parameters for reading (or writing) outside their module's forward (a weight-norm logger, an
    export, a custom loss using an embedding matrix), and release them after.

    With ``modifier_rank=None`` writes made inside are discarded; with ``modifier_rank=r`` the values rank ``r``
    holds at exit are broadcast to every rank and written into the shards and the fp32 master weights (DeepSpeed's
    ``GatheredParameters(params, modifier_rank)``). A collective: every rank must enter it with the same parameters.
    Parameters not managed by stage 3 pass through untouched.
    """
    if not enabled:
        yield
        return
    if isinstance(params, torch.Tensor):
        params = [params]
    # One order on every rank, whatever order the caller's collection has (transformers passes a set); None entries
    # (a module's absent bias, which transformers passes) are skipped, as DeepSpeed skips them.
    params = sorted((p for p in params if p is not None),
                    key=lambda p: (registry.order_of(p) is None, registry.order_of(p) or 0))
    if any(has_slice(p) for p in params):      # built under init_sharded, before initialize
        states = {id(p): open_full(p) for p in params if has_slice(p)}
        try:
            yield
        finally:
            for p in params:
                if id(p) in states:
                    close_full(p, states.pop(id(p)), modifier_rank)
        return
    owners = dict.fromkeys(o for o in map(registry.owner_of, params) if o is not None)   # in order, once each
    with contextlib.ExitStack() as stack:
        for owner in owners:
            stack.enter_context(owner.gathered(params, modifier_rank))
        yield


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns (DeepSpeed's
    ``zero.register_external_parameter``): its unit is then gathered before ``module``'s forward as well. Works
    before or after ``initialize``; backward needs none (a saved parameter is gathered again: `saved_params`).
    """
    registry.register_external(module, parameter)
    owner = registry.owner_of(parameter)
    if owner is not None:
        owner.add_external(module, parameter)


def param_facts(p: torch.Tensor) -> ParamFacts | None:
    """``p`` as DeepSpeed's stage-3 attributes describe it (`ParamFacts`), read live: from the stage-3 engine
    that holds it (or holds the parameter ``p`` is an exact alias of), or, built under `init_sharded` and not
    yet handed to an engine, from its slice (never available; ``local`` this rank's elements). None for a
    tensor stage 3 does not manage."""
    owner = registry.owner_of(p)
    if owner is not None:
        return owner.describe(p)
    state = registry.slice_of(p)
    if state is None:
        for owner in registry.owners():     # an alias of a held parameter (autograd's unpacked saved tensor)
            held = owner.parameter_viewed_by(p)
            if held is not None:
                return owner.describe(held)
        return None
    piece, rank, world = state
    lo, hi = slice_bounds(p.numel(), rank, world)
    return ParamFacts(tuple(p.shape), p.numel(), False, piece[:hi - lo], False)
