"""One parameter's fp32 master weights and optimizer states, whole or this rank's part: DeepSpeed's
``deepspeed.utils.safe_get_full_fp32_param`` family (``tensor_fragment.py`` in DeepSpeed 0.19.8).

Read and written through the engine's `zero_offload.runtime.state.PartitionedOptimizerState` face: ``layout()`` says which
ranks hold which elements of a parameter, ``state_chunks``/``load_state_chunks`` read and replace a partition (in
memory or on NVMe alike). Kinds: ``master`` (the fp32 weights) and the optimizer's state names (``exp_avg``,
``exp_avg_sq`` for Adam).
"""
from __future__ import annotations

import torch

from zero_offload.comm.passthrough import torch_collective
from zero_offload.runtime.state import STATE_KINDS

__all__ = ["track", "engine_of", "full_state", "local_state", "set_full_state", "set_local_state", "full_grad",
           "local_grad"]

_ENGINES: list = []      # engines built in this process, newest last (weakly: `engine_of` skips closed ones)


def track(engine) -> None:
    """Remember ``engine`` for `engine_of` (called by the DeepSpeed face's ``initialize``)."""
    import weakref
    _ENGINES.append(weakref.ref(engine))


def engine_of(param: torch.nn.Parameter):
    """The newest live engine whose model holds ``param``, or None."""
    for ref in reversed(_ENGINES):
        engine = ref()
        if engine is not None and any(p is param for p in engine.module.parameters()):
            return engine
    return None


def _place(engine, param):
    names = [n for n, p in engine.module.named_parameters(remove_duplicate=False) if p is param]
    for g, layout in enumerate(engine.optimizer_state.layout()):
        for placement in layout.params:
            if placement.name in names:
                return g, placement
    return None, None


def _kind(kind: str) -> str:
    if kind not in STATE_KINDS:
        raise ValueError(f"optimizer state key {kind!r}: zero-offload's partitions hold {', '.join(STATE_KINDS[1:])} "
                         f"(and the fp32 master weights)")
    return kind


def _read_pieces(engine, g: int, pieces, kind: str, out: torch.Tensor) -> None:
    """Copy this rank's ``pieces`` of group ``g``'s ``kind`` into ``out`` (the flattened parameter)."""
    rank = engine.rank if engine.optimizer_state.partitions_count > 1 else 0
    mine = [c for c in pieces if c.rank == rank]
    for lo, chunk in engine.optimizer_state.state_chunks(g):
        t = chunk[kind]
        for c in mine:
            a, b = max(c.part_offset, lo), min(c.part_offset + c.length, lo + t.numel())
            if a < b:
                out[c.param_offset + a - c.part_offset:c.param_offset + b - c.part_offset] = t[a - lo:b - lo]


def full_state(engine, param, kind: str) -> torch.Tensor | None:
    """``param``'s whole ``kind`` (fp32 CPU, ``param``'s full shape), or None if it is not trained. A collective
    where partitions are spread over ranks (each rank fills its pieces, then one all-reduce sums them)."""
    g, placement = _place(engine, param)
    if placement is None:
        return None
    out = torch.zeros(placement.numel, dtype=torch.float32)
    _read_pieces(engine, g, placement.pieces, _kind(kind), out)
    if engine.optimizer_state.partitions_count > 1:
        torch_collective("all_reduce")(out)
    return out.view(placement.shape)


def local_state(engine, param, kind: str) -> torch.Tensor | None:
    """This rank's elements of ``param``'s ``kind``, 1-D fp32 CPU, in the parameter's flattened order."""
    g, placement = _place(engine, param)
    if placement is None:
        return None
    rank = engine.rank if engine.optimizer_state.partitions_count > 1 else 0
    mine = [c for c in placement.pieces if c.rank == rank]
    flat = torch.zeros(placement.numel, dtype=torch.float32)
    _read_pieces(engine, g, mine, _kind(kind), flat)
    return torch.cat([flat[c.param_offset:c.param_offset + c.length] for c in mine]) if mine else flat[:0]


def _write(engine, g: int, placement, kind: str, values: torch.Tensor, local: bool) -> None:
    state = engine.optimizer_state
    rank = engine.rank if state.partitions_count > 1 else 0
    whole = {}
    for lo, chunk in state.state_chunks(g):
        for k, t in chunk.items():
            whole.setdefault(k, []).append((lo, t.clone()))
    parts = {k: torch.cat([t for _, t in sorted(v, key=lambda x: x[0])]) for k, v in whole.items()}
    at = 0
    for c in placement.pieces:
        if c.rank != rank:
            continue
        src = values[at:at + c.length] if local else values[c.param_offset:c.param_offset + c.length]
        parts[kind][c.part_offset:c.part_offset + c.length] = src
        at += c.length
    state.load_state_chunks(g, state.group_step(g), [(0, parts)])


def set_full_state(engine, param, kind: str, value: torch.Tensor) -> None:
    """Write ``value`` (``param``'s full shape) as ``param``'s ``kind``: each rank its own pieces; then the 16-bit
    parameters are brought up to date (`after_load`, a collective at stage >= 1).

    Raises:
        ValueError: ``param`` is not trained by ``engine``, an unknown ``kind``, or ``value`` of another size.
    """
    g, placement = _place(engine, param)
    if placement is None:
        raise ValueError("safe_set_full_*: the parameter is not trained by this engine (frozen, or another model's)")
    if value.numel() != placement.numel:
        raise ValueError(f"safe_set_full_*: value has {value.numel()} elements, parameter {placement.name} "
                         f"{placement.numel}")
    _write(engine, g, placement, _kind(kind), value.detach().reshape(-1).float().cpu(), local=False)
    engine.optimizer_state.after_load()


def set_local_state(engine, param, kind: str, value: torch.Tensor) -> None:
    """Write ``value`` (this rank's elements, as `local_state` returns them) as ``param``'s ``kind``; then as
    `set_full_state`."""
    g, placement = _place(engine, param)
    if placement is None:
        raise ValueError("safe_set_local_*: the parameter is not trained by this engine (frozen, or another model's)")
    _write(engine, g, placement, _kind(kind), value.detach().reshape(-1).float().cpu(), local=True)
    engine.optimizer_state.after_load()


def _grad_pieces(engine, param):
    """(placement, this rank's pieces, group g's reduced gradient partition) once every copy into it has landed."""
    g, placement = _place(engine, param)
    if placement is None:
        return None, [], None
    engine.zero.finalize_backward()           # idempotent: the copies into the partitions have landed
    rank = engine.rank if engine.optimizer_state.partitions_count > 1 else 0
    return placement, [c for c in placement.pieces if c.rank == rank], engine.zero.partitions[g].ready()


def full_grad(engine, param) -> torch.Tensor | None:
    """``param``'s reduced gradient (fp32, its full shape, on the partition's device; loss-scaled under fp16), read
    from the ranks' gradient partitions between the boundary backward and ``step``: a collective where partitions
    are spread over ranks. None where ``engine`` does not train ``param``."""
    placement, mine, part = _grad_pieces(engine, param)
    if placement is None:
        return None
    out = torch.zeros(placement.numel, dtype=torch.float32, device=part.device)
    for c in mine:
        out[c.param_offset:c.param_offset + c.length] = part[c.part_offset:c.part_offset + c.length]
    if engine.optimizer_state.partitions_count > 1:
        torch_collective("all_reduce")(out)
    return out.view(placement.shape)


def local_grad(engine, param) -> torch.Tensor | None:
    """This rank's elements of ``param``'s reduced gradient, 1-D fp32, in the parameter's flattened order."""
    placement, mine, part = _grad_pieces(engine, param)
    if placement is None:
        return None
    return torch.cat([part[c.part_offset:c.part_offset + c.length].float() for c in mine]) if mine else \
        torch.zeros(0, device=part.device)
