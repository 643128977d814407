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

from zero_offload.runtime.host_thread import HostThread
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
    """Adam/AdamW over one partition per param group, stepped on the host -- `CPUAdam`'s fused kernel -- wherever
    the states live in host memory (``offload_optimizer.device = cpu``, or a CPU compute device), else by torch's
    fused device AdamW.

    Ordering is enforced here, not by callers: the step reads each gradient only after its partition's copies have
    landed (`GradSource.ready`), and the kernel writes a host buffer only after the copies up that read it last
    have finished.

    Args:
        parts: per group, this rank's 16-bit (or fp32) parameter partition, 1-D: a slice of the flat buffer
            (stages 0-2) or the concatenated unit shards (stage 3); updated in place by `step`.
        hparams: per group, dict(lr, betas, eps, weight_decay, adamw_mode, bias_correction).
        offload: keep states on the host, separate from the compute device's buffers.
        copies: the copy engine; its ``host_empty`` page-locks host buffers (``offload_optimizer.pin_memory``).
        host_params: the parts are host memory themselves (stage 3 ``offload_param``).
        policy: when the step runs (`StepPolicy`): ``DELAYED`` writes the parts only at `publish` (the chunks go up
            into ``incoming``); ``SPECULATIVE`` steps the boundary's pieces during backward (`PieceSpeculation`).
        state_dtype: dtype of the host Adam moments, fp32 or bf16 (``bf16.bf16_optimizer_states``).
        host_cpus: for a step beside training, the cores `host_thread` is pinned to, one kernel thread each
            (``cpuadam_cores_perc``); None: torch's thread count.
        chunk: elements per host-step chunk and per copy up (``offload_optimizer.copy_chunk``).
        speculated: ``SPECULATIVE``: the share of each partition speculated (``super_offload_fraction``, `banks`).
        master_dtype: fp32, or bf16 (DeepSpeed's ``bf16_master_weights_and_grads``, bf16 parts, states on the host):
            each master is then the bf16 parameter itself -- the part when it is host memory, else a pinned copy
            that the copies up read -- updated in fp32 and rounded back as ``rounding`` says.
        rounding, seed, index_bases: the bf16 masters' rounding ("nearest" or "stochastic"), the run's key and,
            per group, the partition's first element in the group's numbering (`CPUAdam`).
        grads_on_device: offloaded, synchronous: the gradients stay on the device and the host step pulls them
            down chunk by chunk (``offload_optimizer.gradients_on_device``, `zero_offload.hoststep.grad_stream`).

    Attributes (besides `PartitionOptimizer`'s):
        masters: per group, the master partition (fp32, or bf16: ``master_dtype``), shape (partition numel,).
        outs: per group, the 16-bit tensor the host kernel writes updated parameters into (the partition itself on
            a CPU device or for host shards; the delayed update's pinned buffer under accumulation), or None
            (`_out_over_grad`; else rounded from the masters through a small pinned `StagingRing`).
        incoming: per group, with the delayed update or super_offload and device parts, a device tensor like the
            part (P x d bytes) that the step's chunks land in until `publish`; else None.

    Raises:
        ValueError: ``bias_correction = false`` with the states on an accelerator (torch's Adam has no
            such switch), bf16 masters there or over parts that are not bf16, or ``grads_on_device`` with the
            states on the device or another policy than the synchronous one.
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
                master, out = self._bf16_master(part, policy.beside_training), None
            elif offload and (policy.beside_training or not (host_params and not sixteen_bit)):
                # fp32 masters are only read by the kernel (and copied up in fp32 runs): pinned only then.
                master = (copies.host_empty(part.numel(), torch.float32) if not sixteen_bit
                          else torch.empty(part.numel(), dtype=torch.float32)).copy_(part)
                # 16-bit host shards (stage 3) are written by the kernel in place, unless deferred.
                out = part if (sixteen_bit and host_params and not self.deferred) else None
            elif not sixteen_bit:
                master, out = part, None     # fp32 where the step runs: the parameters are their own master
            else:
                master, out = part.float(), (part if self.on_host else None)
            self.masters.append(master)
            self.outs.append(out)
        # Landing buffers: the delayed step's chunks (or super_offload's pieces) go up into them while training
        # runs; `publish` copies them over the parameters on the device: the boundary queues no partition-sized copy.
        self.incoming = [torch.empty_like(p) if policy.beside_training and offload and not host_params else None
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
        # The speculative step: only with the fused host kernel.
        bank = (SwapBank(self.optimizer, copies) if speculated >= 1.0 else UndoBank(self.optimizer, speculated))
        self.speculation = (PieceSpeculation(self.optimizer, bank, self.host_threads, self.host_thread,
                                            self.chunk) if speculative and self.on_host else None)
        if self.speculation is not None and self.incoming[0] is not None:
            # Each speculated piece's 16-bit parameters go up into the landing buffers at once, from a pinned buffer
            # (or, masters of the parameters' dtype, from the bank's masters).
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
        """The `PartitionOptimizer` step (``lrs``: host step only). Deferred, it may run on a background thread,
        and with ``publish=False`` the updated parameters wait in ``outs``/``masters``/``incoming`` until `publish`.

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
        """Write group(s) ``groups`` (default: all) of the parts from the masters, rounded to the parts' dtype, where
        the two are separate tensors, and drop the masters' ``.grad``."""
        for g in range(len(self.parts)) if groups is None else groups:
            self.masters[g].grad = None
            if self.masters[g].data_ptr() != self.parts[g].data_ptr():
                self.parts[g].copy_(self.masters[g])

    def begin_speculation(self, grad_scale: float) -> list[FinalRanges]:
        """`PartitionOptimizer.begin_speculation`: piece by piece (`PieceSpeculation`)."""
        self.speculation.begin(grad_scale)
        # Copies up may still read the bank (the live state a step ago) and the pinned outputs.
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
        """A stepped piece [lo, hi) of group ``g`` goes up into its landing buffer from ``source`` (its pinned 16-bit
        output or a master; None: rounded from the master through the ring) once the compute stream read the buffer
        (`incoming_free`); ``source`` is bound by the stepping thread, as the copy may run after the banks swap."""
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
        self.up.pending.append(handle)

    def _copy_incoming(self, g: int, lo: int, hi: int) -> None:
        """The delayed step's chunk [lo, hi) of group ``g`` goes up into its landing buffer from where the kernel
        wrote it (or the masters), once the compute stream has read the buffer's previous contents."""
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
        reads where that has their dtype (one micro-step per step, or stage 1), each chunk copied up from there
        (DeepSpeed's step-plus-copy, with no pass re-reading the master). Else None: up through the ring."""
        part = self.parts[g]
        if self.master_is_param(g):          # bf16 masters: the copies read the master, the kernel writes no out
            self.published_from[g] = self.masters[g]
            return None
        self.published_from[g] = grad if part.dtype != torch.float32 and grad.dtype == part.dtype else None
        return self.published_from[g]

    def _host_step(self, grads: list[torch.Tensor], grad_scale: float, lrs) -> None:
        start = time.perf_counter()
        # Each finished chunk starts its copy up at once, overlapping the rest of the host step (ZeRO-Offload
        # paper, Sec. 4.2): into the parameters, or their landing buffers (delayed); host shards need no copy.
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
        """The chunks ``(group, lo, hi)`` in the host step's order: group by group; the delayed update's from the
        end, as the next backward refills the gradient buffer they share (`zero_offload.offload.buffer_lease`)."""
        chunks = [(g, lo, min(p.numel(), lo + self.chunk))
                  for g, p in enumerate(self.parts) for lo in range(0, p.numel(), self.chunk)]
        return chunks[::-1] if self.deferred else chunks

    def _deferred_out(self, g: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Where the deferred host step writes group ``g``'s 16-bit parameters: over the gradient, as `_out_over_grad`
        (the kernel reads each element before it writes it); under accumulation (fp32 gradient) a pinned 16-bit
        buffer, made on first use; fp32 parameters: None (the masters)."""
        part = self.parts[g]
        out = self._out_over_grad(g, grad)
        if out is None and part.dtype != torch.float32 and not self.master_is_param(g):
            if self.outs[g] is None:
                self.outs[g] = self.copies.host_empty(part.numel(), part.dtype)
            self.published_from[g] = out = self.outs[g]
        return out

    def publish_reader(self, g: int) -> tuple[CopyHandle, torch.Tensor] | None:
        """The copy up that `publish` queued from group ``g``'s gradient buffer, and that buffer (None: none), after
        which its owner orders the next copies down into it (`GradPartition.read_by`)."""
        handle, source = self.publish_copies[g], self.published_from[g]
        return None if handle is None or source is self.outs[g] or source is self.masters[g] else (handle, source)

    @torch.no_grad()
    def publish(self) -> None:
        """Deferred mode: the parameters of the last (finished) step become the parts: device parts from the
        landing buffers their chunks went up into as the step ran (`_publish_incoming`; queued here, the copies up
        would hold the training thread as long as they take), host shards rounded from the masters in place."""
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
