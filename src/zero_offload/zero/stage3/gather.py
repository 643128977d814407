"""User-facing stage-3 helpers: building a model already sharded, and reading parameters outside forward."""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from zero_offload.zero.stage3 import registry
from zero_offload.zero.stage3.sharded_init import ShardedInit, close_full, has_slice, open_full

__all__ = ["init_sharded", "gathered_parameters", "register_external_parameter"]


def init_sharded(config=None) -> ShardedInit:
    """Build a model inside this context and no rank ever holds a full copy of it.

    As each module's ``__init__`` returns, its parameters keep only this rank's 1/N slice of the values the
    constructor set and become meta tensors (see `sharded_init`); `zero_offload.initialize` with ZeRO
    stage 3 then assembles each unit from the slices, module by module. The initial weights are
    bit-identical to a normal build with the same seed, as under DeepSpeed's ``zero.Init``. A parameter
    with no constructor values (created on the meta device) is initialised by ``param_init_fn(module)``
    (an argument of ``initialize``) or the module's ``reset_parameters()``; a given ``param_init_fn`` runs
    on every module. Writes a parent's ``__init__`` makes into its already-sharded children
    (``self.apply(self._init_weights)``, Hugging Face's ``post_init``) are kept, one parameter gathered at a
    time (`sharded_init.WriteThrough`); set values after the context under
    ``gathered_parameters(params, modifier_rank=0)``.
    ``config`` is accepted for symmetry with ``deepspeed.zero.Init(config_dict_or_path=...)`` and unused.

    Example::

        with zero_offload.init_sharded():
            model = GPT(cfg)
        engine = zero_offload.initialize(model, config)
    """
    return ShardedInit()


@contextlib.contextmanager
def gathered_parameters(params: Iterable[torch.nn.Parameter] | torch.nn.Parameter,
                        modifier_rank: int | None = None, enabled: bool = True):
    """Gather stage-3 parameters for reading (or writing) outside their module's forward, and release them
    after.

    Needed when code reads a parameter's values outside the forward of the module that owns it (a
    weight-norm logger, an export, a custom loss using an embedding matrix): under stage 3 a parameter
    only holds values while its module runs. With ``modifier_rank=None`` writes made inside are discarded;
    with ``modifier_rank=r`` the values rank ``r`` holds at exit are broadcast to every rank and written into
    the shards and the fp32 master weights (DeepSpeed's ``GatheredParameters(params, modifier_rank)``). A
    collective: every rank must enter it with the same parameters. Parameters not managed by stage 3 pass
    through untouched.
    """
    if not enabled:
        yield
        return
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    if any(has_slice(p) for p in params):      # built under init_sharded, before initialize
        states = {id(p): open_full(p) for p in params if has_slice(p)}
        try:
            yield
        finally:
            for p in params:
                if id(p) in states:
                    close_full(p, states.pop(id(p)), modifier_rank)
        return
    owners = []
    for p in params:
        owner = registry.owner_of(p)
        if owner is not None and owner not in owners:
            owners.append(owner)
    with contextlib.ExitStack() as stack:
        for owner in owners:
            stack.enter_context(owner.gathered(params, modifier_rank))
        yield


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns (DeepSpeed's
    ``zero.register_external_parameter``): its unit is then gathered before ``module``'s forward as well.

    Backward needs no registration: a parameter autograd saved is gathered again when backward reads it
    (see `saved_params`). Works before or after ``initialize``.
    """
    registry.register_external(module, parameter)
    owner = registry.owner_of(parameter)
    if owner is not None:
        owner.add_external(module, parameter)
