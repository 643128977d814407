"""User-facing stage-3 helpers: building a model already sharded, and reading parameters outside forward."""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

__all__ = ["init_sharded", "gathered_parameters"]


@contextlib.contextmanager
def init_sharded(config=None):
    """Build a model inside this context and no rank ever holds a full copy of it.

    Modules are created on the meta device (no memory); `zero_offload.initialize` with ZeRO stage 3 then
    materialises them module by module, initialising each with ``param_init_fn(module)`` (an argument of
    ``initialize``) or the module's own ``reset_parameters()``, and keeps only this rank's shards. This is
    DeepSpeed's ``zero.Init`` / FSDP's meta-device initialisation. ``config`` is accepted for symmetry
    with ``deepspeed.zero.Init(config_dict_or_path=...)`` and unused.

    Example::

        with zero_offload.init_sharded():
            model = GPT(cfg)
        engine = zero_offload.initialize(model, config, param_init_fn=GPT.init_module)
    """
    with torch.device("meta"):
        yield


@contextlib.contextmanager
def gathered_parameters(params: Iterable[torch.nn.Parameter]):
    """Gather stage-3 parameters for reading outside their module's forward, and release them after.

    Needed when code reads a parameter's values outside the forward of the module that owns it (a
    weight-norm logger, an export, a custom loss using an embedding matrix): under stage 3 a parameter
    only holds values while its module runs. Writes made inside are discarded (DeepSpeed's
    ``GatheredParameters`` with ``modifier_rank=None``). A collective: every rank must enter it with the
    same parameters. Parameters not managed by stage 3 pass through untouched.
    """
    units = []
    for p in params:
        u = getattr(p, "_zero_unit", None)
        if u is not None and u not in units:
            units.append(u)
    opened = []
    for u in units:
        if not u.gathered:
            u.fetcher._gather(u, async_op=False)
            opened.append(u)
        else:
            u.wait()
    try:
        yield
    finally:
        for u in opened:
            u.fetcher.release(u)
