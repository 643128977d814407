"""fp32 master weights and Adam moments for this rank's partition only, stepped on the device or the host.

ZeRO stage >= 1 (ZeRO paper, Sec. 5.1, P_os): each rank keeps optimizer states for its 1/N of the flat
parameters. With ``offload_optimizer.device = cpu`` (ZeRO-Offload, Sec. 4) those states live in host
memory and the step is `CPUAdam`'s fused host kernel, which reads the 16-bit gradient, applies the
combined 1/loss_scale x clip scale, and writes the 16-bit parameter into a host buffer copied back up.
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch
from torch.profiler import record_function

from zero_offload.host_thread import HostThread
from zero_offload.offload import timeline
from zero_offload.offload.copies import CopyHandle, Copies
from zero_offload.offload.staging_ring import StagingRing
from zero_offload.optim.cpu_adam import CPUAdam
from zero_offload.hoststep.adam_state import AdamState
from zero_offload.hoststep.copies_up import CopiesUp, storage_of
from zero_offload.hoststep.grad_stream import GradStream
from zero_offload.hoststep.policy import StepPolicy
from zero_offload.hoststep.precision import check_bf16_masters
from zero_offload.hoststep.role import GradSource
from zero_offload.hoststep.banks import SwapBank, UndoBank, speculated_numel
from zero_offload.hoststep.speculation import FinalRanges, PieceSpeculation

__all__ = ["PartitionedAdam"]


class PartitionedAdam(AdamState):
    """The optimizer over one partition per param group.

    The step runs on the host -- `CPUAdam`'s fused kernel -- whenever the states live in host memory: with
    ``offload_optimizer.device = cpu``, and on a machine whose compute device is the CPU. Only with the
    states on an accelerator does torch's fused device AdamW do it.

    Ordering is enforced here, not by callers: the step reads each gradient only after its partition's
    copies have landed (`GradSource.ready`), and the kernel writes a host staging buffer only after the
    copies up that read it at the previous step have finished.

    Args:
        parts: per group, this rank's 16-bit (or fp32) parameter partition, 1-D: a slice of the flat buffer
            (stages 0-2) or the concatenated unit shards (stage 3); updated in place by `step`.
        hparams: per group, dict(lr, betas, eps, weight_decay, adamw_mode, bias_correction).
        offload: keep states on the host, separate from the compute device's buffers.
        copies: the copy engine; its ``host_empty`` page-locks host buffers (``offload_optimizer.pin_memory``).
        host_params: the parts are host memory themselves (stage 3 ``offload_param``).
        policy: when the step runs (`StepPolicy`). ``DELAYED``: the kernel never writes the parts; each finished
            chunk goes up into ``incoming`` as the step runs, and `publish` copies those over the parts later
            (masters and 16-bit outputs are always separate buffers). ``SPECULATIVE``: the boundary's pieces are
            stepped while backward runs (`zero_offload.hoststep.speculation.PieceSpeculation`, into a second
            bank or in place with an undo copy: `zero_offload.hoststep.banks`), and `step` keeps or redoes them
            exactly.
        state_dtype: dtype of the host Adam moments, fp32 or bf16 (``bf16.bf16_optimizer_states``).
        host_cpus: for a step beside training, the cores `host_thread` is pinned to, one kernel thread each
            (``cpuadam_cores_perc``, `zero_offload.offload.host_cores`); None: torch's thread count.
        chunk: elements per host-step chunk and per copy up (``offload_optimizer.copy_chunk``).
        speculated: ``SPECULATIVE``: the share of each partition speculated (``super_offload_fraction``; below 1
            in place with an undo copy, `zero_offload.hoststep.banks`).
        master_dtype: fp32, or bf16 (DeepSpeed's ``bf16_master_weights_and_grads``, bf16 parts, states on the host):
            each master is then the bf16 parameter itself -- the part when it is host memory, else a pinned copy
            that the copies up read -- updated in fp32 and rounded back as ``rounding`` says.
        rounding, seed, index_bases: the bf16 masters' rounding ("nearest" or "stochastic"), the run's key and,
            per group, the partition's first element in the group's numbering (`CPUAdam`).
        grads_on_device: offloaded, synchronous: the gradients stay on the device and the host step pulls them
            down chunk by chunk (``offload_optimizer.gradients_on_device``, `zero_offload.hoststep.grad_stream`).

    Attributes:
        optimizer: the inner ``torch.optim.Optimizer`` whose param groups carry the live learning rates
            (the LR schedule writes into them).
        masters: per group, the master partition (fp32, or bf16: ``master_dtype``), shape (partition numel,).
        outs: per group, the 16-bit tensor the host kernel writes updated parameters into (the partition
            itself on a CPU device or for host shards; with the delayed update under accumulation, a pinned
            16-bit buffer its chunks go up from), or None: offloaded 16-bit parameters headed for the device
            are written over a 16-bit gradient and copied up from there, or (fp32 gradient) rounded from the
            masters chunk by chunk into a small pinned `StagingRing`.
        incoming: per group, with the delayed update and device parts, a device tensor like the part (P x d
            bytes) that the step's chunks land in until `publish`; else None.
        host_thread: with the delayed update or super_offload, the one persistent thread a host step beside
            training runs on -- the delayed step (scheduled by `zero_offload.hoststep.delayed`) or the
            speculated pieces -- pinned to ``host_cpus``; closed by `close`. None otherwise (the step runs on the
            caller's thread).

    Raises:
        ValueError: ``bias_correction = false`` with the states on an accelerator (torch's Adam has no
            such switch), or bf16 masters there or over parts that are not bf16.
    """

    def __init__(self, parts: list[torch.Tensor], hparams: list[dict], offload: bool, copies: Copies,
                 host_params: bool = False, policy: StepPolicy = StepPolicy.SYNCHRONOUS,
                 state_dtype: torch.dtype = torch.float32, host_cpus: tuple[int, ...] | None = None,
                 chunk: int = 1 << 24, speculated: float = 1.0, master_dtype: torch.dtype = torch.float32,
                 rounding: str = "nearest", seed: int = 0, index_bases: Sequence[int] | None = None,
                 grads_on_device: bool = False):
        self.parts, self.offload, self.copies = parts, offload, copies
        host_threads = len(host_cpus) if host_cpus else None
        self.host_threads = host_threads or torch.get_num_threads()
        self.chunk = chunk
        self.host_step_s = 0.0                    # the last host step's own duration, on the thread that ran it
        self.host_params, self.policy = host_params, policy
        deferred = policy is StepPolicy.DELAYED
        speculative = policy is StepPolicy.SPECULATIVE
        self.on_host = offload or parts[0].device.type == "cpu"
        self.masters: list[torch.Tensor] = []
        self.outs: list[torch.Tensor | None] = []
        self.up = CopiesUp(copies)                # the copies up: issued, tracked and waited for
        self.ring: StagingRing | None = None      # made on first use (`_ring`): fp32 gradients, 16-bit parts
        # 16-bit device parts: where the host step wrote each group's parameters (over the gradient, or a pinned
        # buffer: `_out_over_grad`, `_deferred_out`), and the last copy up queued from there.
        self.published_from: list[torch.Tensor | None] = [None] * len(parts)
        self.publish_copies: list[CopyHandle | None] = [None] * len(parts)
        self.sources: list[GradSource] = []      # the gradient sources of the step in progress (or the last)
        if grads_on_device and (not offload or policy is not StepPolicy.SYNCHRONOUS):
            raise ValueError("gradients kept on the device need the synchronous step over offloaded states")
        self.stream = GradStream(copies) if grads_on_device else None
        if master_dtype != torch.float32:
            check_bf16_masters(parts, self.on_host, master_dtype)
        for part in parts:
            sixteen_bit = part.dtype != torch.float32
            if master_dtype != torch.float32:
                master, out = self._bf16_master(part, deferred or speculative), None
            elif offload and (deferred or speculative or not (host_params and not sixteen_bit)):
                # fp32 masters are only read by the kernel (and copied up in fp32 runs): pinned only then.
                master = (copies.host_empty(part.numel(), torch.float32) if not sixteen_bit
                          else torch.empty(part.numel(), dtype=torch.float32)).copy_(part)
                # 16-bit parameter partitions offloaded too (stage 3): the kernel writes straight into
                # them (unless deferred); device partitions are copied up from where the kernel writes them
                # (`_out_over_grad`, `_deferred_out`).
                out = part if (sixteen_bit and host_params and not deferred) else None
            elif not sixteen_bit:
                master, out = part, None     # fp32 where the step runs: the parameters are their own master
            else:
                master, out = part.float(), (part if self.on_host else None)
            self.masters.append(master)
            self.outs.append(out)
        # The delayed update's device-side landing buffers: its background step copies each finished chunk up into
        # them while the next forward and backward run on the parameters; `publish` copies them over the
        # parameters on the device, so the boundary neither queues a partition-sized copy up nor waits for one.
        # super_offload lands its speculated pieces there the same way, while backward runs.
        self.incoming = [torch.empty_like(p) if (deferred or speculative) and offload and not host_params else None
                         for p in parts]
        self.incoming_free: CopyHandle | None = None   # where the compute stream last read them (`publish`)
        self.params_free: CopyHandle | None = None     # the compute that read the parts, at a synchronous step
        groups = [{"params": [m], **h} for m, h in zip(self.masters, hparams)]
        if self.on_host:
            for group, base in zip(groups, index_bases or [0] * len(groups)):
                group["index_base"] = base           # stochastic rounding's element numbering (`CPUAdam`)
            self.optimizer = CPUAdam(groups, state_dtype=state_dtype, num_threads=host_threads,
                                     chunk_size=self.chunk, rounding=rounding, seed=seed)
        else:
            for g in groups:
                if not g.pop("bias_correction"):
                    raise ValueError("optimizer.params.bias_correction = false needs the optimizer states on "
                                     "the host (offload_optimizer.device = 'cpu'); torch's device Adam "
                                     "always corrects bias")
            adamw = [g.pop("adamw_mode") for g in groups][0]
            self.optimizer = (torch.optim.AdamW if adamw else torch.optim.Adam)(groups, fused=True)
        # One host-step thread for whichever policy runs the step beside training (its tasks start it).
        self.host_thread = (HostThread("host-step", copies.device, host_cpus)
                            if policy.beside_training and self.on_host else None)
        # The speculative step (super_offload): only with the fused host kernel over offloaded states.
        bank = (SwapBank(self.optimizer, copies) if speculated >= 1.0 else UndoBank(self.optimizer, speculated))
        self.speculation = (PieceSpeculation(self.optimizer, bank, self.host_threads, self.host_thread,
                                            self.chunk) if speculative and self.on_host else None)
        if self.speculation is not None and self.incoming[0] is not None:
            # Each speculated piece's 16-bit parameters are written to a pinned buffer and go up into the landing
            # buffers at once (masters of the parameters' dtype, fp32 or bf16: from the bank's masters); a step that
            # stands only copies the landing buffers over the parameters on the device.
            self.speculation.outs = [copies.host_empty(speculated_numel(p.numel(), speculated), p.dtype)
                                     if p.dtype != m.dtype else None for p, m in zip(parts, self.masters)]
            self.speculation.on_piece = self._land_speculated

    def _bf16_master(self, part: torch.Tensor, beside: bool) -> torch.Tensor:
        """A bf16 part's bf16 master: the part itself where it is host memory stepped in place, else a pinned copy
        (device parts: the copies up read it; a step beside training writes the parts only when it publishes)."""
        if self.offload and (beside or not self.host_params):
            return self.copies.host_empty(part.numel(), part.dtype).copy_(part)
        return part

    def adam_steps(self, g: int) -> bool:   # noqa: D102 -- False for `PartitionedMuon`'s Muon groups
        return True
    @property
    def deferred(self) -> bool:
        """The delayed update's layout: the kernel never writes the parts; `publish` does (from the policy)."""
        return self.policy is StepPolicy.DELAYED

    @torch.no_grad()
    def step(self, grads: Sequence[GradSource], grad_scale: float, lrs: Sequence[float] | None = None,
             publish: bool = True) -> None:
        """One step of every group's partition with the gradients ``grads`` (the `PartitionOptimizer` role:
        ready sources of the partitions' shapes, training dtype or fp32) times ``grad_scale``; the updated
        16-bit partition ends up in the flat buffer (or, deferred with ``publish=False``, in ``outs``/``masters``
        until `publish`). ``lrs`` overrides the groups' learning rates (host step only). Safe to run in a
        background thread when deferred.

        Raises:
            RuntimeError: a gradient source with copies still in flight (`GradSource.ready`).
        """
        ready = [g.ready() for g in grads]
        self.sources = list(grads)        # told which chunks the step is done with (`GradSource.released`)
        if self.speculation is not None and self.speculation.active:
            if self.speculation.settle(grad_scale, ready):      # the speculated step stands: publish it
                start = time.perf_counter()
                self.published_from = [None] * len(self.parts)
                if self.incoming[0] is not None:
                    self.up.join()      # every piece's copy up is queued
                    self._publish_incoming()
                else:
                    self.write_parts()
                self.host_step_s = self.speculation.total_s + time.perf_counter() - start
                return
            self.up.join()     # the dropped pieces' copies up are queued before the step's own
        if self.on_host:
            self._host_step(ready, grad_scale, lrs)
            if self.deferred and publish:
                self.publish()
            elif self.host_params and not self.deferred:   # fp32 host shards apart from their masters (super_offload)
                self.write_parts([g for g, out in enumerate(self.outs) if out is None])
            return
        with record_function("zero_offload.optimizer.device_step"):
            for i, (master, g) in enumerate(zip(self.masters, ready)):
                if not self.adam_steps(i):          # a Muon group (`zero_offload.hoststep.muon`)
                    continue
                if g.dtype != torch.float32:
                    master.grad = g.float().mul_(grad_scale)
                else:
                    master.grad = g if grad_scale == 1.0 else g.mul(grad_scale)
            self.optimizer.step()
            self.write_parts()

    @torch.no_grad()
    def write_parts(self, groups: Iterable[int] | None = None) -> None:
        """Write group(s) ``groups`` (default: all) of the parameter partitions from the fp32 masters, rounded
        to the partitions' dtype, where the two are separate tensors (fp32 partitions stepped where they are
        are their own masters), and drop the masters' ``.grad``."""
        for g in range(len(self.parts)) if groups is None else groups:
            self.masters[g].grad = None
            if self.masters[g].data_ptr() != self.parts[g].data_ptr():
                self.parts[g].copy_(self.masters[g])

    def begin_speculation(self, grad_scale: float) -> list[FinalRanges]:
        """The boundary micro-step starts (``super_offload``): its gradient pieces are stepped with ``grad_scale``
        as they land. Returns one `FinalRanges` per group, for its gradient partition to report them to."""
        self.speculation.begin(grad_scale)
        # The second bank was the live state a step ago, and the pinned outputs were read: copies up may still
        # read them.
        spec = self.speculation
        reads = [*spec.bank.tensors(), *(spec.result(g) for g in range(len(self.parts))),
                 *(o for o in spec.outs if o is not None)]
        self.up.wait_reads({storage_of(t) for t in reads})
        self.publish_copies = [None] * len(self.parts)
        return self.speculation.sinks()

    def discard_speculation(self) -> None:
        """The boundary takes no step (fp16 overflow, or a checkpoint load): drop what was speculated."""
        if self.speculation is not None:
            self.speculation.discard()
            self.up.join()

    def _land_speculated(self, g: int, lo: int, hi: int, source: torch.Tensor | None) -> None:
        """A stepped piece [lo, hi) of group ``g`` goes up into its landing buffer (`incoming`) from ``source`` (its
        pinned 16-bit output, or an fp32 master), or where None (stepped in place at the boundary with the 16-bit
        staging only the speculated share's size) rounded from the master through the ring, once the compute
        stream has read the buffer's previous contents (`incoming_free`). The source is bound by the thread that
        stepped the piece: the issuing thread may run the copy after the boundary swapped the banks."""
        def copy(g: int, lo: int, hi: int) -> None:
            if source is None:
                handle, reads = self._ring().copy_up(self.incoming[g][lo:hi], self.masters[g][lo:hi],
                                                     self.incoming_free), 0
            else:
                handle = self.copies.to_device(self.incoming[g][lo:hi], source, after=self.incoming_free)
                reads = storage_of(source)
            self.publish_copies[g] = handle
            self.up.track(handle, reads)
        self.up.issue(copy, g, lo, hi)

    def _copy_up(self, g: int, lo: int, hi: int) -> None:
        """Queue the copy up of group ``g``'s updated elements [lo, hi): from where the kernel wrote them in 16
        bits (over the gradient), else rounded from the masters through the ring, else the fp32 masters."""
        source, part = self.published_from[g], self.parts[g]
        after = self.params_free
        if self.stream is not None and self.stream.over_slot[g]:     # written over the gradient's slot
            handle, reads = self.stream.copy_up(part[lo:hi], g, lo, after), 0
        elif source is not None:
            self.publish_copies[g] = handle = self.copies.to_device(part[lo:hi], source[lo:hi], after)
            reads = storage_of(source)
        elif part.dtype != torch.float32:
            handle, reads = self._ring().copy_up(part[lo:hi], self.masters[g][lo:hi], after), 0
        else:
            handle = self.copies.to_device(part[lo:hi], self.masters[g][lo:hi], after)
            reads = storage_of(self.masters[g])
        self.up.track(handle, reads)
        self.up.add_pending(handle)

    def _copy_incoming(self, g: int, lo: int, hi: int) -> None:
        """The delayed step's chunk [lo, hi) of group ``g`` goes up into its landing buffer (`incoming`), from
        where the kernel wrote it in 16 bits (over the gradient, or the pinned output) or from the fp32 masters,
        once the compute stream has read the buffer's previous contents (`incoming_free`)."""
        source = self.published_from[g] if self.published_from[g] is not None else self.masters[g]
        handle = self.copies.to_device(self.incoming[g][lo:hi], source[lo:hi], after=self.incoming_free)
        self.publish_copies[g] = handle
        self.up.track(handle, storage_of(source))
        self.sources[g].released(lo, hi, handle)

    def _ring(self) -> StagingRing:
        if self.ring is None:
            self.ring = StagingRing(self.copies, self.parts[0].dtype, max(p.numel() for p in self.parts))
        return self.ring

    def _out_over_grad(self, g: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Where the host step writes group ``g``'s 16-bit parameters headed for the device: over the gradient it
        reads, when the gradient has the parameters' dtype (one micro-step per step, or stage 1), and each chunk
        is copied up from there (DeepSpeed's step-plus-copy, without a pass that re-reads the fp32 master to
        round it). Otherwise None: the chunks go up through the ring."""
        part = self.parts[g]
        if self.master_is_param(g):          # bf16 masters: the copies read the master, the kernel writes no out
            self.published_from[g] = self.masters[g]
            return None
        self.published_from[g] = grad if part.dtype != torch.float32 and grad.dtype == part.dtype else None
        return self.published_from[g]

    def _host_step(self, grads: list[torch.Tensor], grad_scale: float, lrs) -> None:
        start = time.perf_counter()
        # Each finished chunk starts its copy up at once, overlapping the rest of the host step (ZeRO-Offload
        # paper, Sec. 4.2's pipelining of the parameter swap-in with the CPU step): into the parameters, or under
        # the delayed update into their landing buffers. Parameters on the host (stage 3 offload_param) are
        # written in place: no copy.
        on_chunk, outs = None, self.outs
        self.publish_copies = [None] * len(self.parts)
        if self.offload and not self.host_params and self.deferred:
            on_chunk = lambda g, _param, lo, hi: self.up.issue(self._copy_incoming, g, lo, hi)  # noqa: E731
            outs = [self._deferred_out(g, grad) for g, grad in enumerate(grads)]
        elif self.offload and not self.host_params:
            self.params_free = self.copies.compute_point()    # on the thread that ran the compute
            on_chunk = lambda g, _param, lo, hi: self.up.issue(self._copy_up, g, lo, hi)  # noqa: E731
            outs = [self._out_over_grad(g, grad) for g, grad in enumerate(grads)]
        self.up.wait_reads({storage_of(t) for t in (*self.masters, *outs) if t is not None})
        on_chunk = timeline.with_chunks_recorded(on_chunk, "host_step")
        chunks = [(g, lo, hi) for g, lo, hi in self._chunk_order() if self.adam_steps(g)]
        if self.stream is not None:
            outs = self.stream.begin(grads, outs, chunks)
        try:
            with record_function("zero_offload.optimizer.host_step"):
                self.optimizer.step(grads=[[g] if self.adam_steps(i) else [None] for i, g in enumerate(grads)],
                                    grad_scale=grad_scale, outputs=[[o] for o in outs], on_chunk=on_chunk,
                                    lrs=lrs, order=None if on_chunk is None and self.stream is None else
                                    [(g, 0, lo, hi) for g, lo, hi in chunks],
                                    fetch=None if self.stream is None else self.stream.fetch)
        finally:             # also where the kernel failed: no copy of this step is left to a later one
            self.up.join()               # every chunk's copy is queued (and its handle known) before the step ends
            self.up.release()
            if self.stream is not None:
                self.stream.finish()
        self.host_step_s = time.perf_counter() - start

    def _chunk_order(self) -> list[tuple[int, int, int]]:
        """The chunks ``(group, lo, hi)`` in the order the host step walks them: group by group; the delayed
        update's from the end, the order the next backward refills the gradient buffer it shares with the step
        (`zero_offload.offload.buffer_lease`)."""
        chunks = [(g, lo, min(p.numel(), lo + self.chunk))
                  for g, p in enumerate(self.parts) for lo in range(0, p.numel(), self.chunk)]
        return chunks[::-1] if self.deferred else chunks

    def _deferred_out(self, g: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Where the deferred host step writes group ``g``'s 16-bit parameters: over the gradient it reads, when
        the gradient has the parameters' dtype (one micro-step per step, or stage 1). The kernel reads each
        gradient element before it writes that element's parameter, so no separate publish buffer exists (2 bytes
        per parameter of pinned memory less). Under accumulation (fp32 gradient) a pinned 16-bit
        buffer, made on first use. fp32 parameters are published from the masters: None."""
        part = self.parts[g]
        out = self._out_over_grad(g, grad)
        if out is None and part.dtype != torch.float32 and not self.master_is_param(g):
            if self.outs[g] is None:
                self.outs[g] = self.copies.host_empty(part.numel(), part.dtype)
            self.published_from[g] = out = self.outs[g]
        return out

    def publish_reader(self, g: int) -> tuple[CopyHandle, torch.Tensor] | None:
        """The copy up that `publish` queued from group ``g``'s gradient buffer, and that buffer: its owner
        orders the next copies down into it after the copy (`GradPartition.read_by`). None when publish read
        no gradient buffer."""
        handle, source = self.publish_copies[g], self.published_from[g]
        return None if handle is None or source is self.outs[g] or source is self.masters[g] else (handle, source)

    @torch.no_grad()
    def publish(self) -> None:
        """Deferred mode: the parameters of the last (finished) step become the parts.

        Device parts: the step's chunks went up into the landing buffers (`incoming`) while it ran; here the
        compute stream waits for the last of those copies and copies the buffers over the parts on the device.
        Queuing the copies up here instead would hold the training thread as long as the copies take: the driver
        accepts only a few chunks ahead. Host shards (stage 3 ``offload_param``) are rounded from the masters in
        place."""
        with record_function("zero_offload.optimizer.publish"):
            if self.host_params:
                for part, master in zip(self.parts, self.masters):
                    part.copy_(master)
                return
            self._publish_incoming()

    def _publish_incoming(self) -> None:
        """The compute stream waits for each group's last copy into its landing buffer and copies the buffer over
        the parameters, on the device."""
        for g, part in enumerate(self.parts):
            if self.publish_copies[g] is not None:
                self.publish_copies[g].wait_stream()
                part.copy_(self.incoming[g])
        self.incoming_free = self.copies.compute_point()

    def close(self) -> None:
        """End the host-step and issuing threads and let the copies up in flight land (from `Engine.close`)."""
        if self.speculation is not None:
            self.speculation.close()
        if self.host_thread is not None:
            self.host_thread.close()
        self.up.close()
