"""`NvmeState`: the state face of `zero_offload.hoststep.nvme_adam.NvmeAdam` (checkpoints, accounting).

The masters and moments in swap files, streamed one sub-group at a time through the owner's buffer pool. A mixin of
the one class that holds the files: it uses the owner's sub-group layout (``units``, ``parts``), pool (``pool``,
``_views``, ``_free_slot``) and I/O (``_io``, ``_wait``, ``_guard``).
"""
from __future__ import annotations

import torch

from zero_offload.runtime.state import STATE_KINDS, WholeGroupState, checked_chunks

__all__ = ["NvmeState", "KINDS"]

KINDS = STATE_KINDS


class NvmeState(WholeGroupState):
    """Streamed state of the NVMe optimizer (see the module docstring)."""

    # -- state, streamed -------------------------------------------------------------------------------
    @torch.no_grad()
    def _write_initial_masters(self) -> None:
        """The masters from the parameters, sub-group by sub-group; the moments stay sparse zeros."""
        nslots = len(self.pool)
        for k, (g, i, lo, hi) in enumerate(self.units):
            slot = k % nslots
            self._free_slot(slot)
            src = self.parts[g][lo:hi] if self.param_io is None else self.param_io.read_range(g, lo, hi)
            self._views(slot, hi - lo)[0].copy_(src)
            self._writes[slot] = self._io(slot, k, write=True, kinds=("master",))
        self.swapper.flush()
        self._writes = [None] * nslots

    def read_state(self, g: int, kind: str) -> torch.Tensor:
        """Group ``g``'s ``kind`` (master, exp_avg, exp_avg_sq) as a new fp32 CPU tensor of the partition's
        length, read through the pool one sub-group at a time."""
        return self._guard(self._read_state, g, kind)

    def _read_state(self, g: int, kind: str) -> torch.Tensor:
        if kind not in self.group_kinds(g):             # a state this group does not keep: zeros
            return torch.zeros(self.parts[g].numel(), dtype=torch.float32)
        out = torch.empty(self.parts[g].numel(), dtype=torch.float32)
        k = KINDS.index(kind)
        for u, (_g, _i, lo, hi) in enumerate(self.units):
            if _g != g:
                continue
            self._free_slot(0)
            self._wait(self._io(0, u, write=False, kinds=(kind,)))
            out[lo:hi].copy_(self._views(0, hi - lo)[k])
        return out

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Host memory held for the states: only the sub-group pool, as ``nvme_buffers`` (the states: files)."""
        return {"master": [], "exp_avg": [], "exp_avg_sq": [], "nvme_buffers": [b.raw for b in self.pool.buffers]}

    def swapped_bytes(self) -> dict[str, int]:
        """Bytes of swap files by state kind (whole sub-groups; the moments' files fill on the first step), and
        with super_offload the second bank's as ``speculative_state``."""
        out = {kind: sum(self.file_bytes(p.numel(), kind) for g, p in enumerate(self.parts)
                         if kind in self.group_kinds(g)) for kind in KINDS}
        if self.banks == 2:
            out["speculative_state"] = sum(out.values())
        return out

    @torch.no_grad()
    def write_master(self, g: int, offset: int, values: torch.Tensor) -> None:
        """Overwrite group ``g``'s master at element ``offset`` with ``values`` (1-D; rounded to nearest where the
        master is bf16): each sub-group it touches is read, patched and written back through the pool."""
        self._guard(self._write_master, g, offset, values.detach().reshape(-1).float().cpu())

    def _write_master(self, g: int, offset: int, values: torch.Tensor) -> None:
        end = offset + values.numel()
        for u, (_g, _i, lo, hi) in enumerate(self.units):
            if _g != g or lo >= end or hi <= offset:
                continue
            self._free_slot(0)
            self._wait(self._io(0, u, write=False, kinds=("master",)))
            a, b = max(lo, offset), min(hi, end)
            self._views(0, hi - lo)[0][a - lo:b - lo].copy_(values[a - offset:b - offset])
            self._wait(self._io(0, u, write=True, kinds=("master",)))

    def staging_tensors(self) -> list[torch.Tensor]:
        """Host buffers the 16-bit outputs of a sub-group pass through (to the device or a parameter file), and
        super_offload's landing buffers where the parameters are host memory."""
        return [t for t in self.staging if t is not None] + (self.landing if self.host_params else [])

    def incoming_tensors(self) -> list[torch.Tensor]:
        """super_offload's landing buffers where the parameters are on the device; else none."""
        return [] if self.host_params else list(self.landing)

    # -- the chunked state API of zero_offload.runtime.state.PartitionedOptimizerState --------------------------------
    def group_step(self, g: int) -> int:
        return int(self.steps[g])

    def state_chunks(self, g: int, chunk_numel: int = 1 << 24):
        """Group ``g``'s state streamed from its files: (offset, {kind: fp32 CPU tensor}), one sub-group at a time
        (``chunk_numel`` is not used). An fp32 piece is a view of a pool buffer, valid until the next piece is asked
        for (copy it to keep it); a bf16 state is widened into a new tensor."""
        for u, (_g, _i, lo, hi) in enumerate(self.units):
            if _g == g:
                yield lo, self._guard(self._read_sub_group, u)

    def _read_sub_group(self, u: int) -> dict[str, torch.Tensor]:
        g, _, lo, hi = self.units[u]
        self._free_slot(0)
        self._wait(self._io(0, u, write=False))
        kept = self.group_kinds(g)
        return {kind: view.float() if kind in kept else torch.zeros(hi - lo)
                for kind, view in zip(KINDS, self._views(0, hi - lo))}

    @torch.no_grad()
    def load_state_chunks(self, g: int, step: int, chunks) -> None:
        """Replace group ``g``'s state from pieces of any size that cover the partition in order, written to the
        files one sub-group at a time, and each sub-group's parameters from its masters (or their swap file).

        Raises:
            ValueError: pieces that do not continue the partition in order or do not cover it.
        """
        self._guard(self._load_chunks, g, int(step), chunks)

    def _load_chunks(self, g: int, step: int, chunks) -> None:
        n = self.parts[g].numel()
        subs = [u for u, unit in enumerate(self.units) if unit[0] == g]
        covered, k = 0, 0
        self._free_slot(0)
        for lo, piece in checked_chunks(chunks, g, n):
            length = piece["master"].numel()
            while covered < lo + length:
                _g, _i, s_lo, s_hi = self.units[subs[k]]
                take = min(s_hi, lo + length) - covered
                for view, kind in zip(self._views(0, s_hi - s_lo), KINDS):
                    view[covered - s_lo:covered - s_lo + take].copy_(piece[kind][covered - lo:covered - lo + take])
                covered += take
                if covered == s_hi:            # a whole sub-group assembled: to its files and parameters
                    self._wait(self._io(0, subs[k], write=True))
                    self._write_params(g, s_lo, self._views(0, s_hi - s_lo)[0])
                    k += 1
        self.steps[g] = step

    def _write_params(self, g: int, lo: int, master: torch.Tensor) -> None:
        if self.param_io is not None:
            self.param_io.write_behind(g, lo, master)
        else:
            self.parts[g][lo:lo + master.numel()].copy_(master)
