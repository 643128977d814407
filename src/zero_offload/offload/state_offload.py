"""DeepSpeed's ``engine.offload_states()`` / ``reload_states()``: free the device between training steps.

RL frameworks (TRL, OpenRLHF, verl) move a training engine's device memory to the host while a generation engine
uses the GPU, and back before the next step (DeepSpeed 0.16+, ``OffloadStateTypeEnum``). Here every device-side
tensor the engine holds is named by `memory_breakdown`'s kinds; each kind belongs to one of DeepSpeed's state
types (`STATE_TYPES`, `state_type`). Moving is done per storage, not per tensor: the storage's bytes are copied
to a host buffer and the storage is resized to zero bytes, then resized back and refilled on reload. The tensor
objects and every view of them (the model's parameters are views into flat buffers) stay what they were, so
training continues bitwise as if nothing had moved, in the middle of gradient accumulation too.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch

__all__ = ["STATE_TYPES", "state_type", "parse_include", "StateOffload"]

# DeepSpeed 0.19.8's OffloadStateTypeEnum values.
STATE_TYPES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")

# memory_breakdown kind -> DeepSpeed state type ("device_<kind>", the device part under offload_optimizer.ratio,
# has its kind's type); a kind not named here is an optimizer state slot (a torch optimizer's buffers).
_KIND_TYPES = {"params": "lp_params", "frozen_params": "lp_params", "param_incoming": "lp_params",
               "grads": "lp_grads", "grad_partition": "lp_grads", "buckets": "contiguous_grad_buffer",
               "master": "hp_params"}


def state_type(kind: str) -> str:
    """DeepSpeed's state type of a `memory_breakdown` kind (e.g. ``exp_avg`` -> ``optim_states``)."""
    base = kind[len("device_"):] if kind.startswith("device_") else kind
    return _KIND_TYPES.get(base, "optim_states")


def parse_include(include: Iterable | None) -> set[str]:
    """The state types ``include`` names (DeepSpeed's enum members or their string values); all when None.

    Raises:
        ValueError: an entry that is not one of `STATE_TYPES`, named with the valid ones.
    """
    if include is None:
        return set(STATE_TYPES)
    chosen = set()
    for item in include:
        name = getattr(item, "value", item)
        if name not in STATE_TYPES:
            raise ValueError(f"offload_states(include=...): {item!r} is not a state type; the types are "
                             f"{', '.join(STATE_TYPES)} (DeepSpeed's OffloadStateTypeEnum)")
        chosen.add(name)
    return chosen


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StateOffload:
    """The storages moved off one engine's device and their host copies.

    Args:
        device: the engine's compute device (only its storages move).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.moved: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}   # storage id -> (storage, host copy)
        self.types: set[str] = set()            # the state types offloaded now
        self.pinned: dict[int, torch.Tensor] = {}   # pinned host buffers kept for the next offload (DeepSpeed's)
        self.pending: list[torch.Tensor] = []   # host copies an asynchronous reload still reads

    def accepts(self, device, include) -> bool:
        """Whether an ``offload_states(include, device)`` call moves anything: False (with DeepSpeed's warning)
        for ``device="none"``.

        Raises:
            ValueError: another device than ``"cpu"`` (``"nvme"`` is refused, as by DeepSpeed), or an unknown
                type in ``include`` (`parse_include`).
        """
        target = str(getattr(device, "value", device))
        if target == "none":
            warnings.warn("offload_states(device='none'): no device given, nothing offloaded (as DeepSpeed)",
                          stacklevel=3)
            return False
        if target != "cpu":
            raise ValueError(f"offload_states(device={target!r}): states can be offloaded to 'cpu' only "
                             f"(NVMe is refused, as by DeepSpeed)")
        parse_include(include)
        return True

    def offload_kinds(self, kinds: dict, include, pin_memory: bool, non_blocking: bool) -> int:
        """Move the device-side tensors of ``kinds`` (`memory_breakdown`'s ``{kind: (side, tensors)}``) whose
        state type ``include`` names (`parse_include`); returns the device bytes freed."""
        types = parse_include(include)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)      # nothing queued still reads or writes what moves
        self.types |= types        # offloaded from now on, even where none of them lives on the device
        by_type: dict[str, list[torch.Tensor]] = {}
        for kind, entry in kinds.items():
            if isinstance(entry, tuple) and entry[0] == "device" and state_type(kind) in types:
                by_type.setdefault(state_type(kind), []).extend(entry[1])
        return self.offload(by_type, pin_memory, non_blocking)

    def offload(self, tensors_by_type: dict[str, list[torch.Tensor]], pin_memory: bool,
                non_blocking: bool) -> int:
        """Move the storages of the given tensors to host memory; returns the device bytes freed. A storage
        already moved, empty, or on another device is left alone."""
        self._finish_reload()
        pin = pin_memory and self.device.type == "cuda"
        freed = 0
        for kind, tensors in tensors_by_type.items():
            for t in tensors:
                storage = t.untyped_storage()
                key, nbytes = storage._cdata, storage.nbytes()
                if t.device != self.device or nbytes == 0 or key in self.moved:
                    continue
                host = self.pinned.get(key) if pin else None
                if host is None or host.numel() != nbytes:
                    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                    if pin:
                        self.pinned[key] = host
                host.copy_(_bytes_view(storage), non_blocking=non_blocking and pin)
                # Stream-ordered: the caching allocator hands the freed block only to work queued after the copy.
                storage.resize_(0)
                self.moved[key] = (storage, host)
                freed += nbytes
            self.types.add(kind)
        return freed

    def reload(self, non_blocking: bool) -> None:
        """Bring every moved storage back to the device, bitwise (the same storage objects, new memory)."""
        self._finish_reload()
        asynchronous = non_blocking and self.device.type == "cuda"
        for storage, host in self.moved.values():
            storage.resize_(host.numel())
            _bytes_view(storage).copy_(host, non_blocking=asynchronous and host.is_pinned())
            if asynchronous:
                self.pending.append(host)
        if asynchronous:
            self.reload_done = torch.cuda.current_stream(self.device).record_event()
        self.moved.clear()
        self.types.clear()

    def _finish_reload(self) -> None:
        if self.pending:
            self.reload_done.synchronize()
            self.pending.clear()

    def check(self, what: str) -> None:
        """Raises RuntimeError naming ``what`` while states are offloaded."""
        if self.types:
            raise RuntimeError(f"engine.{what}() while the engine's states are offloaded "
                               f"({', '.join(sorted(self.types))}): call engine.reload_states() first")
