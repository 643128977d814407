"""Activation checkpoints in host memory: the inputs of checkpointed layers wait in pinned host buffers between the
forward and their recompute in backward (DeepSpeed's ``activation_checkpointing.cpu_checkpointing``; ALST,
arXiv 2506.13996, Sec. 3.4).

With activation checkpointing, what a layer keeps for backward is its input: everything inside is recomputed. For
a decoder of L layers that is L x micro-batch x sequence x hidden 16-bit values on the device, what dominates at
long sequences. DeepSpeed moves them only for models that call ``deepspeed.checkpointing.checkpoint``, and its
copies are synchronous; transformers' ``offload=True`` copies on the compute stream. Here:

- What moves: every tensor that a checkpoint saves as its input -- ``torch.utils.checkpoint`` (reentrant or not,
  so Hugging Face's gradient checkpointing and our GPT's), or ``deepspeed.checkpointing.checkpoint`` -- seen by a
  saved-tensors hook around the engine's forward. A checkpoint saves its inputs from torch.utils.checkpoint's own
  code, which is how a saved tensor is told apart from the ones other layers save (those stay where they are).
- How: each goes down on the device-to-host copy stream once the next checkpoint input arrives (so the last
  layer's input, needed first in backward, stays on the device), into an exact-size pinned buffer from a pool.
  In backward, unpacking layer i's input waits only for its own copy up, and queues the copies up of the next
  `prefetch` inputs backward will need, so they land while layer i recomputes. The copy streams order everything
  by events (`zero_offload.offload.copies`); the simulated streams check the waits on the CPU.
- Tensors under ``min_bytes`` stay on the device, and so does anything not contiguous, and the first
  ``device_inputs`` checkpoint inputs of each forward (``cpu_checkpointing_device_inputs``: where the host cannot
  hold them all, the planner keeps some on the device; the first are the last backward needs).

The second mode (`keep_layers`, ``activation_checkpointing.cpu_layers``): chosen blocks that are not checkpointed
keep every activation they save (parameters aside) in host memory instead of on the device, moved the same way:
PCIe time instead of the recompute's FLOPs, block by block. A block's tensors go down when it ends, each storage once
however many ops save it. Their counts and pool are their own (`layer_counts`).

Training is bitwise the same: the bytes come back as they went.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass

import torch

from zero_offload.offload import simulated
from zero_offload.offload.copies import Copies, CopyHandle

__all__ = ["CheckpointOffload", "OffloadCounts", "from_checkpoint", "request", "requested", "for_engine",
           "model_blocks"]

CHECKPOINT_MODULE = "torch.utils.checkpoint"
# Frames between the saved-tensors hook and the checkpoint code that saves the input (torch 2.x: 1-2).
FRAMES_TO_CHECK = 4
_requested = False


def request(enabled: bool) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure(checkpoint_in_cpu=...)``: engines built afterwards offload
    checkpoint inputs as if the config set ``activation_checkpointing.cpu_checkpointing``."""
    global _requested
    _requested = bool(enabled)


def requested() -> bool:
    return _requested


def from_checkpoint() -> bool:
    """Whether the tensor being saved is a checkpoint's input: the save comes from torch.utils.checkpoint's code
    (``_CheckpointFrame.save_inputs`` without reentrance, ``CheckpointFunction``'s ``save_for_backward`` with it)."""
    frame = sys._getframe(2)                     # past this function and the pack hook
    for _ in range(FRAMES_TO_CHECK):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == CHECKPOINT_MODULE:
            return True
        frame = frame.f_back
    return False


@dataclass
class OffloadCounts:
    """Running totals: checkpoint inputs sent to host memory (tensors, bytes), copied back (bytes), kept on the
    device for their size or layout or their place in the forward (tensors), and the pinned bytes the pool holds."""
    offloaded: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    kept: int = 0                 # too small or not contiguous
    on_device: int = 0            # among the first ``device_inputs`` of a forward
    pool_bytes: int = 0


CHECKPOINT, LAYER = "checkpoint", "layer"      # a checkpoint's input; anything a block in `keep_layers` saves


class _Held:
    """One saved tensor: on the device until sent down, then in a pinned host buffer until copied back."""

    __slots__ = ("owner", "kind", "index", "device", "host", "down", "up", "up_handle", "__weakref__")

    def __init__(self, owner: "CheckpointOffload", kind: str, index: int, tensor: torch.Tensor):
        self.owner, self.kind, self.index, self.device = owner, kind, index, tensor
        self.host: torch.Tensor | None = None
        self.down: CopyHandle | None = None
        self.up: torch.Tensor | None = None
        self.up_handle: CopyHandle | None = None

    def __del__(self):
        if self.host is not None:                # the graph holding it is gone: the buffer goes back to the pool
            self.owner.give_back(self.host, self.up_handle or self.down, self.kind)


class CheckpointOffload:
    """The saved-tensors hooks (`hooks`) and the pinned pool behind them, one per engine.

    Args:
        copies: the engine's copy engine (`zero_offload.offload.copies.make_copies`): streams and events on CUDA,
            synchronous or simulated on the CPU.
        min_bytes: smaller checkpoint inputs stay on the device (bytes, >= 0).
        prefetch: copies up queued ahead of backward's need (>= 1).
        device_inputs: the first checkpoint inputs of each forward that stay on the device (>= 0).

    Raises:
        ValueError: ``min_bytes`` or ``device_inputs`` < 0, or ``prefetch`` < 1 (names all three).
    """

    def __init__(self, copies: Copies, min_bytes: int = 1 << 20, prefetch: int = 2, device_inputs: int = 0):
        if min_bytes < 0 or prefetch < 1 or device_inputs < 0:
            raise ValueError(f"CheckpointOffload: min_bytes and device_inputs must be >= 0 and prefetch >= 1, got "
                             f"{min_bytes}, {device_inputs}, {prefetch}")
        self.copies, self.min_bytes, self.prefetch = copies, min_bytes, prefetch
        self.device_inputs = device_inputs       # the first checkpoint inputs of a forward that stay
        self._inputs_seen = 0                    # checkpoint inputs of this forward large enough to move
        self.counts = OffloadCounts()            # checkpoint inputs
        self.layer_counts = OffloadCounts()      # the activations of the blocks in `keep_layers`
        self._in_layers = 0                      # depth of `keep_layers` blocks whose forward runs now
        self._depth = 0                          # `hooks` entered and not left
        self.checkpoint_inputs = True            # False: only the blocks of `keep_layers` move
        self._pool: dict[tuple, list[tuple[torch.Tensor, CopyHandle | None]]] = {}
        self._forward: list[weakref.ref] = []    # this forward's inputs, in the order they were saved
        self._latest: _Held | None = None        # kept on the device until a newer one arrives
        self._block: dict[tuple, _Held] = {}     # what the running `keep_layers` block saved, by storage and view

    @contextlib.contextmanager
    def hooks(self):
        """The context to run a forward in: checkpoint inputs go to host memory as described above. Reentrant: the
        engine's forward enters it, and so does the blocks' parent module (`attach`), for code that calls an inner
        module rather than the engine (ArcticTraining's tiled loss); the outermost entry starts a new forward."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._forward, self._latest, self._depth, self._inputs_seen = [], None, 1, 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._depth = 0

    def attach(self, module: torch.nn.Module) -> list:
        """Run ``module``'s forwards with autograd under `hooks` (its hooks' handles returned)."""
        entered: list = []

        def enter(m, args):
            if torch.is_grad_enabled():
                context = self.hooks()
                context.__enter__()
                entered.append(context)

        def leave(m, args, output):
            if entered:
                entered.pop().__exit__(None, None, None)
        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]

    def keep_layers(self, blocks: list[torch.nn.Module]) -> list:
        """The second mode: what ``blocks`` save in their forward goes to host memory too (parameters stay). Returns
        the hooks' handles."""
        def enter(module, args):
            self._in_layers += 1

        def leave(module, args, output):
            self._in_layers -= 1
            if not self._in_layers:              # the block is done: what it saved goes down, each storage once
                for held in self._block.values():
                    self._send_down(held)
                self._block.clear()
        return [h for b in blocks for h in (b.register_forward_pre_hook(enter),
                                            b.register_forward_hook(leave, always_call=True))]

    def memory_breakdown(self) -> dict[str, dict]:
        """The pinned bytes each kind holds (``checkpoint_inputs``, ``layer_activations``), as the engine's
        ``memory_breakdown`` lists them; a kind with none is left out."""
        return {kind: {"bytes": c.pool_bytes, "numel": c.pool_bytes, "side": "host"}
                for kind, c in (("checkpoint_inputs", self.counts), ("layer_activations", self.layer_counts))
                if c.pool_bytes}

    def _counts(self, kind: str) -> OffloadCounts:
        return self.counts if kind == CHECKPOINT else self.layer_counts

    def _pack(self, tensor: torch.Tensor):
        kind = CHECKPOINT if self.checkpoint_inputs and from_checkpoint() else (
            LAYER if self._in_layers and not isinstance(tensor, torch.nn.Parameter) else None)
        if kind is None:
            return tensor
        if tensor.nbytes < self.min_bytes or not tensor.is_contiguous() or tensor.layout != torch.strided:
            self._counts(kind).kept += 1
            return tensor
        if kind == LAYER:
            # held on the device until the block ends (`keep_layers`), so a storage saved twice moves once
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
            if key not in self._block:
                self._block[key] = _Held(self, kind, len(self._forward), tensor)
                self._forward.append(weakref.ref(self._block[key]))
            return self._block[key]
        self._inputs_seen += 1
        if self._inputs_seen <= self.device_inputs:
            self.counts.on_device += 1
            return tensor
        held = _Held(self, kind, len(self._forward), tensor)
        self._forward.append(weakref.ref(held))
        previous, self._latest = self._latest, held
        if previous is not None:
            self._send_down(previous)
        return held

    def _send_down(self, held: _Held) -> None:
        tensor = held.device
        held.host = self._take(tensor, held.kind)
        held.down = self.copies.to_host(held.host, tensor)
        held.device = None                       # the copy stream holds the device memory until it has read it
        counts = self._counts(held.kind)
        counts.offloaded += 1
        counts.bytes_down += tensor.nbytes

    def _unpack(self, packed):
        if not isinstance(packed, _Held):
            return packed
        if packed.device is not None:            # never sent down: the last of its forward
            return packed.device
        if packed.up is None:
            self._bring_up(packed)
        tensor, handle = packed.up, packed.up_handle
        packed.up = None                         # the recompute holds it now; a second unpack copies it up again
        handle.wait_stream()                     # the compute waits for this copy only
        for ref in reversed(self._forward[max(0, packed.index - self.prefetch):packed.index]):
            earlier = ref()
            if earlier is not None and earlier.device is None and earlier.up is None:
                self._bring_up(earlier)
        return tensor

    def _bring_up(self, held: _Held) -> None:
        held.down.synchronize()                  # the host buffer is whole before the copy up reads it
        # Allocated on the compute stream, which frees it after the recompute; the copy stream waits for the compute
        # queued so far (the backward of the layers after this one), then runs beside the next recompute.
        held.up = self._poisoned(torch.empty_like(held.host, device=self.copies.device))
        held.up_handle = self.copies.to_device(held.up, held.host)
        self._counts(held.kind).bytes_up += held.host.nbytes

    def _take(self, like: torch.Tensor, kind: str) -> torch.Tensor:
        free = self._pool.get((kind, like.shape, like.dtype))
        if free:
            buffer, last = free.pop()
            if last is not None:
                last.synchronize()               # its last copy up has read it
            return self._poisoned(buffer)
        buffer = self.copies.host_empty(like.numel(), like.dtype).view(like.shape)
        self._counts(kind).pool_bytes += buffer.nbytes
        return self._poisoned(buffer)

    @staticmethod
    def _poisoned(buffer: torch.Tensor) -> torch.Tensor:
        # Under simulated streams a copy's destination reads NaN until the copy lands, so a read that misses its
        # wait changes the result (on the CPU a new buffer may hold the very bytes it should receive).
        if simulated.enabled() and buffer.is_floating_point():
            buffer.fill_(float("nan"))
        return buffer

    def give_back(self, buffer: torch.Tensor, last: CopyHandle | None, kind: str = CHECKPOINT) -> None:
        """A host buffer whose saved tensor is gone returns to its kind's pool (``last``: the copy that read or
        wrote it last, waited for before the buffer is written again)."""
        self._pool.setdefault((kind, buffer.shape, buffer.dtype), []).append((buffer, last))


def _longest_list(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.ModuleList | None]:
    """The model's longest ``ModuleList`` (a decoder's layers) and the module holding it; (None, None) without one."""
    pairs = [(parent, child) for parent in model.modules() for child in parent.children()
             if isinstance(child, torch.nn.ModuleList)]
    return max(pairs, key=lambda pair: len(pair[1])) if pairs else (None, None)


def model_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's blocks: the entries of its longest ``ModuleList`` (a decoder's layers), empty without one."""
    blocks = _longest_list(model)[1]
    return list(blocks) if blocks is not None else []


def for_engine(section, model: torch.nn.Module, copies: Copies) -> CheckpointOffload | None:
    """The engine's offload from its ``activation_checkpointing`` config section, or None when nothing asks for one:
    ``cpu_checkpointing``, ``deepspeed.checkpointing.configure(checkpoint_in_cpu=True)``, transformers'
    ``activation_checkpointing_enable(offload=True)`` (taken over: `hf_checkpoint_offload`) or ``cpu_layers``.

    Raises:
        ValueError: ``cpu_layers`` beyond the model's blocks (names the key, the value and the block count).
    """
    from zero_offload.offload.hf_checkpoint_offload import take_over
    inputs = take_over(model) or section.cpu_checkpointing or requested()
    if not (inputs or section.cpu_layers):
        return None
    offload = CheckpointOffload(copies, section.cpu_checkpointing_min_bytes, section.cpu_checkpointing_prefetch,
                                section.cpu_checkpointing_device_inputs)
    offload.checkpoint_inputs = inputs
    if section.cpu_layers:
        blocks = model_blocks(model)
        if section.cpu_layers > len(blocks):
            raise ValueError(f"config key 'activation_checkpointing.cpu_layers' = {section.cpu_layers}, but the "
                             f"model has {len(blocks)} blocks (the entries of its longest ModuleList)")
        offload.keep_layers(blocks[:section.cpu_layers])
    holder = _longest_list(model)[0]
    if holder is not None and holder is not model:     # a forward of the decoder alone is watched too
        offload.attach(holder)
    return offload
