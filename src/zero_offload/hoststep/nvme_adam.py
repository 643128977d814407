"""`NvmeAdam`: a rank's optimizer partition with its masters and Adam moments in swap files.

ZeRO-Infinity (arXiv 2104.07857, Sec. 5-6; DeepSpeed's ``PipelinedOptimizerSwapper``): the partition is cut into
sub-groups of ``sub_group_size`` elements, streamed through a pool of ``buffer_count`` aligned buffers -- read i+1
ahead (``pipeline_read``), step i with the fused host kernel, write i-1 behind (``pipeline_write``) -- so host memory
for optimizer state is the pool, not the model (docs/nvme.md).

Files: ``{nvme_path}/zero_offload/rank{r}/group{g}.{master,exp_avg,exp_avg_sq}.swp`` (super_offload's second bank:
``group{g}.spec.{kind}.swp``), sub-group i at byte offset ``i x sub x`` its element size (``sub`` rounded up to whole
4096-byte blocks for O_DIRECT); the moments start as sparse files (zeros). `close`, collection or exit removes them.
"""
from __future__ import annotations

import functools
import time
import weakref
from pathlib import Path
from typing import Sequence

import torch

from zero_offload.runtime.host_thread import HostThread
from zero_offload.nvme.fail_stop import FailStop
from zero_offload.nvme.buffers import ALIGNMENT, BufferPool, align_up
from zero_offload.nvme import state_files
from zero_offload.nvme.swapper import Pending, Swapper
from zero_offload.offload.copies import Copies
from zero_offload.optim.cpu_adam import CPUAdam, step_seed
from zero_offload.optim.fused_adam import fused_adam_step
from zero_offload.hoststep.role import GradSource
from zero_offload.hoststep.speculation import SubGroupSpeculation, aligned_pieces
from zero_offload.hoststep.nvme_state import KINDS, NvmeState

__all__ = ["NvmeAdam"]


class _SwappedMasters(Sequence):
    """The master partitions as a sequence: ``masters[g]`` reads group g's file into a new fp32 tensor."""

    def __init__(self, owner: "NvmeAdam"):
        self._owner = owner

    def __len__(self) -> int:
        return len(self._owner.parts)

    def __getitem__(self, g: int) -> torch.Tensor:
        if not 0 <= g < len(self):
            raise IndexError(g)
        return self._owner.read_state(g, "master")


class NvmeAdam(FailStop, NvmeState):
    """Adam/AdamW over this rank's partitions with the states on NVMe, stepped on the host.

    Args:
        parts: per group, this rank's parameter partition (1-D, 16-bit or fp32, host or device); the step
            writes the updated parameters into it.
        hparams: per group, dict(lr, betas, eps, weight_decay, adamw_mode, bias_correction).
        directory: this rank's swap directory (a killed run's state files in it are deleted first).
        sub_group_size: elements per sub-group (the unit of swapping).
        buffer_count: at most this many sub-group buffers in the pool, each 12 bytes x sub-group elements; the
            pool holds the ones the pipeline has in flight (`pool_slots`).
        pipeline_read / pipeline_write: overlap the read of i+1 / the write of i-1 with the step of i.
        block_size / thread_count / queue_depth: the swapper's request piece (bytes), I/O threads
            and requests in flight per thread.
        param_io: the parameters' own swap files (stage 3 ``offload_param.device = nvme``, a
            `zero_offload.nvme.param_store.NvmeParamStore`): ``parts`` are then meta tensors, the initial masters
            are read with ``read_range(g, lo, hi)``, and each sub-group's parameters written with
            ``write_behind(g, lo, values)``, still in flight when the step returns.
        speculative: ``super_offload``: the boundary's sub-groups are stepped during backward on `host_thread`
            (pinned to ``host_cpus``; `SubGroupSpeculation`), their parameters held in ``landing`` until kept.
        host_params: the parts are host memory themselves (stage 3 ``offload_param.device = cpu``): the landing
            buffers are host memory too (counted as ``param_staging``; else as ``param_incoming``).
        master_dtype, state_dtype: the files' dtypes of the masters (fp32, or bf16: the master is then the bf16
            parameter, sent on from the pool as it is) and of both moments (fp32 or bf16).
        rounding, seed, index_bases: bf16 masters' rounding and its key (`PartitionedAdam`).

    Raises:
        NvmeIOError: a failed read or write (naming the file). After one, every later `step` and state read
            raises too: the files may hold a half-written step, and only the last checkpoint is sound.
    """

    fail_stop_subject = "NVMe optimizer states"

    on_host = True

    def __init__(self, parts: list[torch.Tensor], hparams: list[dict], copies: Copies, directory: Path,
                 sub_group_size: int, buffer_count: int, pipeline_read: bool = False, pipeline_write: bool = False,
                 block_size: int = 1 << 20, thread_count: int = 1, param_io=None,
                 queue_depth: int = 1, speculative: bool = False, host_cpus: tuple[int, ...] | None = None,
                 host_params: bool = False, master_dtype: torch.dtype = torch.float32,
                 state_dtype: torch.dtype = torch.float32, rounding: str = "nearest", seed: int = 0,
                 index_bases: Sequence[int] | None = None):
        self.parts, self.copies, self.param_io = parts, copies, param_io
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        self.dtypes = (master_dtype, state_dtype, state_dtype)       # of the master, exp_avg and exp_avg_sq files
        self.sizes = tuple(d.itemsize for d in self.dtypes)
        self.rounding, self.seed = rounding, seed
        self.index_bases = list(index_bases or [0] * len(parts))
        self.sub = state_files.sub_group_numel([p.numel() for p in parts], sub_group_size, self.sizes)
        self.units = [(g, i, lo, min(p.numel(), lo + self.sub))
                      for g, p in enumerate(parts) for i, lo in enumerate(range(0, p.numel(), self.sub))]
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.iterdir():                # a killed run's state files: reclaimed
            if stale.name.endswith(state_files.STATE_FILES):
                stale.unlink(missing_ok=True)
        self.swapper = Swapper(directory, block_size=block_size, thread_count=thread_count,
                               queue_depth=queue_depth)
        self._finalizer = weakref.finalize(self, self.swapper.close)
        self.banks = 2 if speculative else 1
        self.bank = [0] * len(self.units)            # per sub-group: the bank holding its live state
        for g, p in enumerate(parts):
            for kind in self.group_kinds(g):
                for bank in range(self.banks):
                    self.swapper.open(self._name(g, kind, bank), self.file_bytes(p.numel(), kind))
        slots = state_files.pool_slots(buffer_count, pipeline_read, pipeline_write)
        self.pool = BufferPool(slots, sum(self.sizes) * self.sub, pin=copies.pin)   # DeepSpeed pins them too
        self.staging = [None] * slots
        self._writes: list[Pending | None] = [None] * slots
        self.steps = [0] * len(parts)
        self.broken: BaseException | None = None
        self.optimizer = CPUAdam([{"params": [torch.zeros(0)], **h} for h in hparams])   # live lrs
        self.masters = _SwappedMasters(self)
        self.timings = {"read_wait_s": 0.0, "adam_s": 0.0, "write_wait_s": 0.0}
        self.host_threads = len(host_cpus) if host_cpus else torch.get_num_threads()
        self.host_step_s = 0.0                    # the last step's own duration (reads and writes included)
        self.host_params = host_params
        self.host_thread = HostThread("host-step", copies.device, host_cpus) if speculative else None
        self.speculation = (SubGroupSpeculation([(g, lo, hi) for g, _, lo, hi in self.units], len(parts),
                                                functools.partial(self._guard, self._speculate), self.host_thread)
                            if speculative else None)
        self.landing = [torch.empty_like(p) for p in parts] if speculative else []
        self.landing_free = None                  # where the compute stream last read the landing buffers
        self._spec_slot = 0
        self._spec_lrs: list[float] = []
        self._guard(self._write_initial_masters)

    # -- layout ----------------------------------------------------------------------------------------
    def group_kinds(self, g: int) -> tuple[str, ...]:
        """The states group ``g`` keeps in files: the master and both Adam moments."""
        return KINDS

    def file_bytes(self, numel: int, kind: str = "master") -> int:
        """Bytes of ``kind``'s state file of a partition of ``numel`` elements (whole sub-groups)."""
        return state_files.file_bytes(numel, self.sub, self.sizes[KINDS.index(kind)])

    def _region(self, k: int) -> int:
        """Byte offset of state ``k``'s region in a pool buffer (whole 4096-byte blocks: `sub_group_numel`)."""
        return sum(self.sizes[:k]) * self.sub

    @staticmethod
    def _name(g: int, kind: str, bank: int = 0) -> str:
        return f"group{g}.{kind}.swp" if bank == 0 else f"group{g}.spec.{kind}.swp"

    def _views(self, slot: int, n: int) -> list[torch.Tensor]:
        buf = self.pool.buffers[slot]
        return [buf.view(dtype, n, self._region(k)) for k, dtype in enumerate(self.dtypes)]

    def _io(self, slot: int, u: int, write: bool, kinds=KINDS, bank: int | None = None) -> list[Pending]:
        """Start reads or writes of sub-group ``u``'s ``kinds`` (aligned lengths: the padding goes along) in
        ``bank`` (default: the one holding its live state)."""
        g, i, lo, hi = self.units[u]
        bank = self.bank[u] if bank is None else bank
        buf = self.pool.buffers[slot]
        out = []
        for k, kind in enumerate(KINDS):
            if kind in kinds and kind in self.group_kinds(g):
                nbytes = align_up((hi - lo) * self.sizes[k], ALIGNMENT)
                view = buf.raw[self._region(k):self._region(k) + nbytes]
                op = self.swapper.write if write else self.swapper.read
                out.append(op(self._name(g, kind, bank), view, i * self.sub * self.sizes[k]))
        return out

    def _wait(self, pendings) -> None:
        for p in pendings or ():
            self.swapper.wait(p)

    def _free_slot(self, slot: int) -> None:
        """Wait until nothing still reads from buffer ``slot`` (its write-behind, a copy up)."""
        self._wait(self._writes[slot])
        self._writes[slot] = None
        self.copies.synchronize()

    # -- the step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grads: Sequence[GradSource], grad_scale: float, lrs: Sequence[float] | None = None,
             publish: bool = True) -> None:
        """The `PartitionOptimizer` step, streamed sub-group by sub-group: the updated parameters land in ``parts``
        (or their swap files). Never deferred: ``publish`` is not used.

        Raises:
            RuntimeError: a gradient source with copies still in flight; an earlier I/O error (fail-stop).
            NvmeIOError: a read or write failed.
        """
        start = time.perf_counter()
        ready = [g.ready() for g in grads]
        spec = self.speculation
        if spec is not None and spec.active:
            same_lrs = lrs is None or [float(lr) for lr in lrs] == self._spec_lrs
            if spec.settle(grad_scale, ready, same_lrs):      # the speculated step stands: flip and publish it
                self._guard(self._accept)
                self.host_step_s = spec.total_s + time.perf_counter() - start
                return
            self._guard(self._drain)
        self._guard(self._step, ready, grad_scale, lrs)
        self.host_step_s = time.perf_counter() - start

    def publish(self) -> None:
        """Nothing to publish: the step always writes the parameters (never deferred)."""

    def publish_reader(self, g: int) -> None:
        """Never deferred: no publish reads a gradient buffer."""

    def state_format(self) -> str:
        """The checkpoint's moment slots hold Adam's ``exp_avg`` and ``exp_avg_sq``."""
        return "adam"

    def _step(self, grads: list[torch.Tensor], grad_scale: float, lrs: Sequence[float] | None) -> None:
        self.steps = [s + 1 for s in self.steps]
        self._adam_pass(range(len(self.units)), grads, grad_scale, lrs)
        self._drain_timed()

    def _adam_pass(self, units, grads: list[torch.Tensor], grad_scale: float, lrs: Sequence[float] | None) -> None:
        """The fused Adam step of sub-groups ``units``, streamed (`_stream`)."""
        def adam(k: int, slot: int, a: int, b: int) -> None:
            g = self.units[k][0]
            lr = self.optimizer.param_groups[g]["lr"] if lrs is None else lrs[g]
            self._kernel(k, slot, a, grads[g][a:b], grad_scale, lr, self.steps[g], land=False)
        self._stream([(k, self.units[k][2], self.units[k][3]) for k in units], KINDS, adam)

    def _drain_timed(self) -> None:
        t0 = time.perf_counter()
        self._drain()
        self.timings["write_wait_s"] += time.perf_counter() - t0

    def _stream(self, work: list[tuple[int, int, int]], kinds: tuple[str, ...], step) -> None:
        """One pass over ``work``, (sub-group, a, b) in order: each sub-group's ``kinds`` read into a pool buffer
        (read ahead with ``pipeline_read``), ``step(k, slot, a, b)`` run on elements [a, b) of it, and the
        ``kinds`` written back (behind with ``pipeline_write``). Writes may still be in flight when it returns."""
        nslots = len(self.pool)
        reads: dict[int, list[Pending]] = {}

        def issue_read(j: int) -> None:
            self._free_slot(j % nslots)
            reads[j] = self._io(j % nslots, work[j][0], write=False, kinds=kinds)

        if work:
            issue_read(0)
        for j, (k, a, b) in enumerate(work):
            slot = j % nslots
            if self.pipeline_read and j + 1 < len(work):
                issue_read(j + 1)                      # read-ahead overlaps this sub-group's step
            t0 = time.perf_counter()
            self._wait(reads.pop(j))
            t1 = time.perf_counter()
            step(k, slot, a, b)
            t2 = time.perf_counter()
            self._writes[slot] = self._io(slot, k, write=True, kinds=kinds)
            if not self.pipeline_write:
                self._wait(self._writes[slot])
                self._writes[slot] = None
            t3 = time.perf_counter()
            if not self.pipeline_read and j + 1 < len(work):
                issue_read(j + 1)
            self.timings["read_wait_s"] += t1 - t0
            self.timings["adam_s"] += t2 - t1
            self.timings["write_wait_s"] += t3 - t2

    def _kernel(self, k: int, slot: int, a: int, grad: torch.Tensor, grad_scale: float, lr: float, step: int,
                land: bool) -> None:
        """Step elements [a, a + len(grad)) of sub-group ``k`` (its state in buffer ``slot``) and send the updated
        parameters on (`_send_params`; ``land``: to the landing buffer)."""
        g, _, lo, hi = self.units[k]
        b = a + grad.numel()
        master, exp_avg, exp_avg_sq = (v[a - lo:b - lo] for v in self._views(slot, hi - lo))
        h = self.optimizer.param_groups[g]
        target, out = self._param_outputs(k, slot, a, b, land)
        fused_adam_step(master, grad, exp_avg, exp_avg_sq, step=step, lr=lr,
                        beta1=h["betas"][0], beta2=h["betas"][1], eps=h["eps"],
                        weight_decay=h["weight_decay"], adamw_mode=h["adamw_mode"],
                        bias_correction=h["bias_correction"], grad_scale=grad_scale, out=out,
                        num_threads=self.host_threads, rounding=self.rounding, seed=step_seed(self.seed, step),
                        index_base=self.index_bases[g] + a)
        self._send_params(g, a, target, out, master, land)

    def _param_outputs(self, k: int, slot: int, a: int, b: int,
                       land: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where the updated parameters of elements [a, b) of sub-group ``k`` go: the ``target`` (the
        parameters, or with ``land`` the landing buffer), and ``out``, the host tensor the step writes them into
        where they are 16-bit of fp32 masters (the target itself on the host, else a staging slot), else None."""
        g, _, lo, hi = self.units[k]
        part = self.parts[g][a:b]
        target = self.landing[g][a:b] if land else part
        if part.dtype == self.dtypes[0]:
            return target, None
        if self.param_io is None and target.device.type == "cpu":
            return target, target
        return target, self._staging(slot, part.dtype)[a - lo:b - lo]

    def _send_params(self, g: int, a: int, target: torch.Tensor, out: torch.Tensor | None, master: torch.Tensor,
                     land: bool) -> None:
        """Send the updated parameters at element ``a`` on from ``out`` (None: the ``master``): to their swap file
        (behind), up to the device (a landing buffer once publish read it), or into host parameters."""
        if self.param_io is not None:
            self.param_io.write_behind(g, a, master if out is None else out)
        elif target.device.type != "cpu":
            self.copies.to_device(target, master if out is None else out,
                                  after=self.landing_free if land else None)
        elif out is None:
            target.copy_(master)

    # -- super_offload: the speculative step (zero_offload.hoststep.speculation) ------------------------------------
    def begin_speculation(self, grad_scale: float) -> list:
        """`PartitionOptimizer.begin_speculation`: sub-group by sub-group (`SubGroupSpeculation`)."""
        self.speculation.begin(grad_scale)
        self._spec_lrs = [float(h["lr"]) for h in self.optimizer.param_groups]
        return self.speculation.sinks()

    def discard_speculation(self) -> None:
        """The boundary takes no step (fp16 overflow, or a checkpoint load): drop what was speculated."""
        if self.speculation is not None:
            self.speculation.discard()
            self._guard(self._drain)

    def _speculate(self, k: int, pieces: list, grad_scale: float) -> None:
        """Sub-group ``k`` from its live bank, stepped with the gradient ``pieces`` [(offset, values)] that cover
        it, into the other bank; its parameters land in ``landing``."""
        g = self.units[k][0]
        self._spec_slot = slot = (self._spec_slot + 1) % len(self.pool)
        self._free_slot(slot)
        self._wait(self._io(slot, k, write=False))
        for a, values in sorted(pieces, key=lambda piece: piece[0]):
            for x, y in aligned_pieces(a, a + values.numel()):
                self._kernel(k, slot, x, values[x - a:y - a], grad_scale, self._spec_lrs[g], self.steps[g] + 1,
                             land=True)
        self._writes[slot] = self._io(slot, k, write=True, bank=1 - self.bank[k])

    def _drain(self) -> None:
        """Every write and copy up still in flight done (a speculation's too)."""
        self.swapper.flush()
        self._writes = [None] * len(self.pool)
        self.copies.wait_for_copies()

    def _accept(self) -> None:
        """The speculated step stands: every sub-group's live state is now the other bank, each group has taken
        a step, and the landing buffers are copied over the parameters (on the compute stream)."""
        self._drain()
        self.bank = [1 - b for b in self.bank]
        self.steps = [s + 1 for s in self.steps]
        for part, landed in zip(self.parts, self.landing):
            part.copy_(landed)
        self.landing_free = self.copies.compute_point()

    def _staging(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        if self.staging[slot] is None:
            self.staging[slot] = self.copies.host_empty(self.sub, dtype)   # copied up from: pinned on CUDA
        return self.staging[slot]

    def close(self) -> None:
        """End the host-step thread (super_offload), wait for outstanding I/O and delete the swap files (also done
        when collected and at exit)."""
        if self.speculation is not None:
            self.speculation.close()
            self.host_thread.close()
        self._finalizer()

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of swap files this rank announced (the moments become real on the first step)."""
        return sum(f.nbytes for f in self.swapper.files.values())
