"""Where a plan keeps each block's activations: kept on the device, recomputed (activation checkpointing), or
recomputed from inputs kept in host memory (``activation_checkpointing.cpu_checkpointing``,
`zero_offload.offload.checkpoint_offload`), or split: the first K inputs on the device, the rest in host memory, where
neither side holds them all (`split_inputs`). Blocks that are not checkpointed keep their activations on the device,
or, where the device cannot hold them all, the first N move to host memory whole (``cpu_layers``, `move_blocks`):
PCIe time instead of the recompute, block by block. `zero_offload.estimate.batching` tries each mode the config
leaves free; the memory model moves the bytes to the host, and this module charges their copies on PCIe."""
from __future__ import annotations

import copy

__all__ = ["checkpoint_modes", "with_inputs_on_host", "input_copy_exposure", "split_inputs", "move_blocks"]


def checkpoint_modes(ckpts: list, raw: dict, model_checkpoints: bool) -> list[tuple]:
    """(checkpointing, inputs on host) pairs to try, the one needing the least device memory last. ``ckpts``: the
    checkpointing values the planner tries; ``model_checkpoints``: the model's own setting where it is not chosen.
    A config that sets ``cpu_checkpointing`` keeps it; otherwise host inputs are tried wherever checkpointing is."""
    given = (raw.get("activation_checkpointing") or {}).get("cpu_checkpointing")
    checkpointed = [c for c in ckpts if c or (c is None and model_checkpoints)]
    if given is not None:
        return [(c, bool(given) and (c or (c is None and model_checkpoints))) for c in ckpts]
    return [(c, False) for c in ckpts] + [(c, True) for c in checkpointed]


def with_inputs_on_host(raw: dict, on_host: bool) -> dict:
    """``raw`` with ``activation_checkpointing.cpu_checkpointing`` set where the mode keeps inputs on the host."""
    if not on_host or (raw.get("activation_checkpointing") or {}).get("cpu_checkpointing"):
        return raw
    out = copy.deepcopy(raw)
    out.setdefault("activation_checkpointing", {})["cpu_checkpointing"] = True
    return out


def input_copy_exposure(moved_bytes: int, pcie: float, forward_s: float, backward_s: float) -> tuple[float, float]:
    """Seconds the checkpoint inputs' copies add to a micro-step's forward and backward: each input goes down on
    the device-to-host stream beside the forward and comes back on the host-to-device stream beside the backward
    (other directions than the gradients' and parameters' copies), so only what outlasts that compute shows."""
    copy_s = moved_bytes / pcie
    return max(0.0, copy_s - forward_s), max(0.0, copy_s - backward_s)


def split_inputs(raw: dict, est, short: dict, ranks: int, measure):
    """Where the host is short and the device is not with every checkpoint input in host memory: ``raw`` with the
    fewest first inputs kept on the device (``cpu_checkpointing_device_inputs``) that bring the host within its
    capacity, with its ``(estimate, short)`` from ``measure(raw)``, if that fits; else ``raw, est, short`` as they
    are. ``short``: bytes missing on each side for all ``ranks`` of the machine (`zero_offload.estimate.plan`);
    a config that sets the key keeps it."""
    each = est.checkpoint_input_bytes
    if not (each and short.get("host") and not short.get("device")):
        return raw, est, short
    kept = -(-short["host"] // (each * ranks))        # each rank keeps as many
    moved = est.host.get("checkpoint_inputs", 0) // each
    return _with_fewest(raw, est, short, "cpu_checkpointing_device_inputs", kept, moved, measure)


def move_blocks(raw: dict, est, short: dict, blocks: int, measure):
    """Where the device is short and the host is not with every block's activations on the device (a decoder not
    checkpointed): ``raw`` with the fewest first blocks whose saved activations move to host memory
    (``activation_checkpointing.cpu_layers``) that bring the device within its capacity, with its ``(estimate,
    short)`` from ``measure(raw)``, if that fits; else ``raw, est, short`` as they are. ``blocks``: the model's;
    a config that sets the key keeps it."""
    each = est.block_activation_bytes
    if not (each and short.get("device") and not short.get("host")):
        return raw, est, short
    return _with_fewest(raw, est, short, "cpu_layers", -(-short["device"] // each), blocks, measure)


def _with_fewest(raw: dict, est, short: dict, key: str, count: int, limit: int, measure):
    """``raw`` with ``activation_checkpointing.<key>`` = ``count`` and its measure, where the config leaves the key
    free, ``count`` <= ``limit`` and that fits; else ``raw, est, short`` as they are."""
    if key in (raw.get("activation_checkpointing") or {}) or count > limit:
        return raw, est, short
    out = copy.deepcopy(raw)
    out.setdefault("activation_checkpointing", {})[key] = count
    est2, short2 = measure(out)
    return (out, est2, short2) if not any(short2.values()) else (raw, est, short)
