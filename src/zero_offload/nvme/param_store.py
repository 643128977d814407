"""`NvmeParamStore`: stage-3 16-bit parameter partitions in swap files (``offload_param.device = nvme``).

ZeRO-Infinity's parameter offload (arXiv 2104.07857, Sec. 5; DeepSpeed's
``AsyncPartitionedParameterSwapper``): each param group's partition of this rank is one file,
``{nvme_path}/zero_offload/rank{r}/group{g}.param.swp``, element ``i`` at byte ``i x itemsize``. A unit's
shard is read into one of ``buffer_count`` aligned host buffers just before its all-gather -- ahead of
time, in the recorded fetch order, through `prefetch` -- and the buffer is taken back as soon as the
gather has read it (`release`). The host memory of parameters is then the pool, ``buffer_count`` buffers
of the largest unit shard, and at most ``max_in_cpu`` elements are read ahead.

Updated partitions are written back after the optimizer step behind it (`write_behind`): each `WRITE_WINDOW`-byte
window of a range is rounded to the training dtype into one of `WRITE_RING` aligned staging buffers and its write
is issued without waiting, so the writes overlap the rest of the step and the rounding of the next window. A write
is waited for only where correctness needs it: before its ring buffer is reused, before any read or write of an
overlapping file range (the next forward's fetch, `read_range`), at `flush` and at `close` (DeepSpeed's
``AsyncPartitionedParameterSwapper._swap_out(async_op=True)`` / ``synchronize_writes``). A write that starts or
ends inside a 4096-byte block reads that block first (O_DIRECT moves whole blocks). A write that fails (ENOSPC,
EIO) raises `NvmeIOError` naming the file at the wait that finds it.

Files left by a killed run are reclaimed at the next start; `close` (or exit) removes them. After an I/O
error every later access raises: the files may hold half a step, only the last checkpoint is sound.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from pathlib import Path

import torch

from zero_offload.nvme.fail_stop import FailStop
from zero_offload.nvme.buffers import ALIGNMENT, AlignedBuffer, align_up
from zero_offload.nvme.swapper import Pending, Swapper

__all__ = ["NvmeParamStore", "PARAM_SUFFIX"]

PARAM_SUFFIX = ".param.swp"
# Bytes of one ring buffer: the unit of a write-behind and of a whole-range read. 8 MiB windows wrote fp32
# parameters 15-25 % faster than 1 MiB ones here (BENCHMARKS.md); the ring is 32 MiB whatever the model.
WRITE_WINDOW = 8 << 20
WRITE_RING = 4        # staging buffers of parameter writes in flight


def _align_down(n: int) -> int:
    return n - n % ALIGNMENT


class NvmeParamStore(FailStop):
    """A rank's stage-3 parameter partitions on NVMe (the `PartitionStore` role, not resident).

    Args:
        numels: per group, elements of this rank's partition.
        units: the stage-3 units whose shards it holds (``index``, ``group``, ``partition_offset``,
            ``shard_numel`` are read); any other unit (frozen parameters) keeps its shard in memory and is
            passed through.
        dtype: the training dtype of the parameters.
        directory: this rank's swap directory (stale ``*.param.swp`` files there are deleted first).
        buffer_count: host buffers in the pool (``offload_param.buffer_count``), >= 1.
        buffer_size: most elements of one buffer (``offload_param.buffer_size``); every unit's shard must
            fit (DeepSpeed asserts the same: "More elements than buffer size").
        max_in_cpu: most parameter elements held in the pool at once by read-ahead
            (``offload_param.max_in_cpu``); the shard being gathered is always allowed.
        block_size / thread_count / queue_depth: the swapper's request piece (bytes), I/O threads
            and requests in flight per thread (``aio``).
        pin: page-lock the read buffers (``offload_param.pin_memory`` with CUDA present): each shard is
            copied up from its buffer asynchronously.

    Raises:
        ValueError: ``buffer_count`` < 1 or a unit shard larger than ``buffer_size`` (naming the key and the
            size needed).
        NvmeIOError: a failed read or write, naming the file.
    """

    fail_stop_subject = "NVMe parameter files"

    resident = False

    def __init__(self, numels: list[int], units: list, dtype: torch.dtype, directory: Path, buffer_count: int,
                 buffer_size: int, max_in_cpu: int, block_size: int = 1 << 20, thread_count: int = 1,
                 queue_depth: int = 1, pin: bool = False):
        largest = max((u.shard_numel for u in units), default=0)
        if buffer_count < 1:
            raise ValueError(f"config key 'zero_optimization.offload_param.buffer_count' = {buffer_count}: the "
                             "parameter pool needs at least 1 buffer")
        if largest > buffer_size:
            raise ValueError(f"config key 'zero_optimization.offload_param.buffer_size' = {buffer_size}: the "
                             f"largest unit partition has {largest} elements; set buffer_size >= {largest}")
        self.dtype, self.itemsize = dtype, torch.empty(0, dtype=dtype).element_size()
        self.numels, self.max_in_cpu = list(numels), max_in_cpu
        self.units = {u.index: u for u in units}
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(f"*{PARAM_SUFFIX}"):
            stale.unlink(missing_ok=True)                 # a killed run's files: reclaimed
        self.swapper = Swapper(directory, block_size=block_size, thread_count=thread_count,
                               queue_depth=queue_depth)
        self._finalizer = weakref.finalize(self, self.swapper.close)
        for g, n in enumerate(numels):
            self.swapper.open(self._name(g), align_up(max(n, 1) * self.itemsize))
        self.buffers = [AlignedBuffer(self.buffer_bytes(largest, dtype), pin) for _ in range(buffer_count)]
        self.window = WRITE_WINDOW      # read once: tests shrink it to make the ring wrap at small sizes
        self.ring = [AlignedBuffer(self.window) for _ in range(WRITE_RING)]
        # per ring buffer: the write still behind from it, (file name, start byte, stop byte, request)
        self.writes: list[tuple[str, int, int, Pending] | None] = [None] * WRITE_RING
        self._ring_next = 0
        self.slot_of: OrderedDict[int, tuple[int, Pending | None]] = OrderedDict()   # unit -> (slot, read)
        self.in_use: set[int] = set()
        self.broken: BaseException | None = None
        self.shards_read_ahead = self.shards_read_on_demand = 0   # how gathers found their shard
        self.peak_resident_numel = 0

    # -- layout ----------------------------------------------------------------------------------------
    @staticmethod
    def _name(g: int) -> str:
        return f"group{g}{PARAM_SUFFIX}"

    def _extent(self, u) -> tuple[int, int, int]:
        """(aligned start byte, aligned length, byte offset of the shard inside it)."""
        lo = u.partition_offset * self.itemsize
        hi = lo + u.shard_numel * self.itemsize
        start = _align_down(lo)
        return start, max(align_up(hi) - start, ALIGNMENT), lo - start

    @staticmethod
    def buffer_bytes(largest_shard_numel: int, dtype: torch.dtype) -> int:
        """Bytes of one pool buffer: a shard's aligned enclosing range, its bytes plus at most one block on
        each side."""
        return align_up(largest_shard_numel * torch.empty(0, dtype=dtype).element_size()) + ALIGNMENT

    @classmethod
    def pool_bytes(cls, largest_shard_numel: int, dtype: torch.dtype, buffer_count: int) -> int:
        """Host bytes of the read pool: ``buffer_count`` buffers of the largest unit shard."""
        return buffer_count * align_up(cls.buffer_bytes(largest_shard_numel, dtype))

    @staticmethod
    def write_ring_bytes() -> int:
        """Host bytes of the write-behind ring: `WRITE_RING` x `WRITE_WINDOW` (whatever the model)."""
        return WRITE_RING * WRITE_WINDOW

    @classmethod
    def bytes_needed(cls, numels: list[int], dtype: torch.dtype) -> int:
        """Bytes of parameter swap files for partitions of ``numels`` elements of ``dtype``."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return sum(align_up(max(n, 1) * itemsize) for n in numels)

    @property
    def bytes_on_disk(self) -> int:
        return sum(f.nbytes for f in self.swapper.files.values())

    def resident_numel(self) -> int:
        """Parameter elements held in the pool now (read ahead or being gathered)."""
        return sum(self.units[i].shard_numel for i in self.slot_of)

    def tensors(self) -> list[torch.Tensor]:
        """The host memory of the read pool (``param_pool`` in `memory_breakdown`)."""
        return [b.raw for b in self.buffers]

    def write_ring_tensors(self) -> list[torch.Tensor]:
        """The host memory of the write-behind ring (``param_write_ring`` in `memory_breakdown`)."""
        return [b.raw for b in self.ring]

    @property
    def pending_writes(self) -> int:
        """Parameter writes issued and not yet waited for (at most `WRITE_RING`)."""
        return sum(w is not None for w in self.writes)

    # -- the PartitionStore role -----------------------------------------------------------------------

    def _view(self, slot: int, u) -> torch.Tensor:
        _start, _length, skip = self._extent(u)
        nbytes = u.shard_numel * self.itemsize
        return self.buffers[slot].raw[skip:skip + nbytes].view(self.dtype)

    def _start_read(self, u, slot: int) -> None:
        start, length, _ = self._extent(u)
        self._wait_writes(self._name(u.group), start, start + length)
        buf = self.buffers[slot].raw[:length]
        self.slot_of[u.index] = (slot, self.swapper.read(self._name(u.group), buf, start))

    def _free_slot(self, evict: bool) -> int | None:
        """A buffer no unit holds; with ``evict`` the oldest read-ahead not being gathered is dropped."""
        taken = {slot for slot, _ in self.slot_of.values()}
        for slot in range(len(self.buffers)):
            if slot not in taken:
                return slot
        if not evict:
            return None
        for index, (slot, pending) in self.slot_of.items():
            if index not in self.in_use:
                self.swapper.wait(pending)
                del self.slot_of[index]
                return slot
        raise RuntimeError(f"config key 'zero_optimization.offload_param.buffer_count' = {len(self.buffers)}: "
                           "every parameter buffer is held by a gather; raise buffer_count")

    def acquire(self, u) -> torch.Tensor:
        if u.index not in self.units:       # a unit kept in memory (frozen parameters): its own shard
            return u.shard
        return self._guard(self._acquire, u)

    def _acquire(self, u) -> torch.Tensor:
        if u.index not in self.slot_of:
            self._start_read(u, self._free_slot(evict=True))
            self.shards_read_on_demand += 1
        else:
            self.shards_read_ahead += 1
        self.peak_resident_numel = max(self.peak_resident_numel, self.resident_numel())
        slot, pending = self.slot_of[u.index]
        if pending is not None:
            self.swapper.wait(pending)
            self.slot_of[u.index] = (slot, None)
        self.in_use.add(u.index)
        return self._view(slot, u)

    def release(self, u) -> None:
        self.in_use.discard(u.index)
        self.slot_of.pop(u.index, None)

    def prefetch(self, u) -> bool:
        if u.index not in self.units:
            return True
        return self._guard(self._prefetch, u)

    def _prefetch(self, u) -> bool:
        if u.index in self.slot_of:
            return True
        if self.resident_numel() + u.shard_numel > self.max_in_cpu:
            return False
        slot = self._free_slot(evict=False)
        if slot is None:
            return False
        self._start_read(u, slot)
        return True

    def write_shard(self, u, values: torch.Tensor) -> None:
        if u.index not in self.units:
            u.shard.copy_(values)
        else:
            self.write_range(u.group, u.partition_offset, values)

    # -- whole ranges (materialisation, the optimizer's output, checkpoints) ---------------------------
    def _drop_reads(self) -> None:
        """Before a write: no read-ahead may hold values the write replaces (or read while it writes)."""
        for index in list(self.slot_of):
            slot, pending = self.slot_of[index]
            self.swapper.wait(pending)
            if index in self.in_use:
                self.slot_of[index] = (slot, None)
            else:
                del self.slot_of[index]

    # -- write-behind ------------------------------------------------------------------------------------
    def _wait_writes(self, name: str | None = None, lo: int = 0, hi: int = 1 << 62) -> None:
        """Wait for the writes behind that touch bytes [lo, hi) of file ``name`` (all of them by default).

        Raises:
            NvmeIOError: such a write failed (naming the file).
        """
        for slot, w in enumerate(self.writes):
            if w is not None and (name is None or (w[0] == name and w[1] < hi and lo < w[2])):
                self._land(slot)

    def _land(self, slot: int) -> None:
        """Wait for the write behind from ring buffer ``slot`` (if any) and free the slot."""
        w, self.writes[slot] = self.writes[slot], None
        if w is not None:
            self.swapper.wait(w[3])

    def _take_ring_buffer(self) -> int:
        """The index of the next ring buffer, once the write behind from it has landed."""
        slot = self._ring_next
        self._ring_next = (slot + 1) % len(self.ring)
        self._land(slot)
        return slot

    @torch.no_grad()
    def write_behind(self, g: int, offset: int, values: torch.Tensor) -> None:
        """Start writing ``values`` (1-D, any float dtype, rounded to the training dtype on the way) at element
        ``offset`` of group ``g``'s partition file and return without waiting: ``values`` is copied into the
        ring as it goes and may change at once. At most `WRITE_RING` windows of `WRITE_WINDOW` bytes stay in
        flight; a later read or write of the same bytes waits for them first.

        Raises:
            NvmeIOError: an earlier write-behind failed and was found while making room in the ring.
            RuntimeError: the store is unusable after an earlier I/O error.
        """
        self._guard(self._write_behind, g, offset, values)

    def _write_behind(self, g: int, offset: int, values: torch.Tensor) -> None:
        self._drop_reads()
        src = values.detach().reshape(-1)
        name, size = self._name(g), self.itemsize
        lo = offset * size
        hi = lo + src.numel() * size
        pos = lo
        while pos < hi:
            start = _align_down(pos)
            stop = min(align_up(hi), start + self.window)
            end = min(hi, stop)
            slot = self._take_ring_buffer()
            self._wait_writes(name, start, stop)      # an older write of these bytes lands first
            win = self.ring[slot].raw[:stop - start]
            if pos > start:          # the head block is shared with bytes before the range
                self.swapper.wait(self.swapper.read(name, win[:ALIGNMENT], start))
            if end < stop:           # so is the tail block, with bytes after it
                self.swapper.wait(self.swapper.read(name, win[-ALIGNMENT:], stop - ALIGNMENT))
            win[pos - start:end - start].view(self.dtype).copy_(src[(pos - lo) // size:(end - lo) // size])
            self.writes[slot] = (name, start, stop, self.swapper.write(name, win, start))
            pos = end

    def flush(self) -> None:
        """Wait for every parameter write behind.

        Raises:
            NvmeIOError: one of them failed (naming the file); RuntimeError: the store is unusable.
        """
        self._guard(self._wait_writes)

    @torch.no_grad()
    def write_range(self, g: int, offset: int, values: torch.Tensor) -> None:
        """`write_behind`, then wait for it: the bytes are in the file when this returns.

        Raises:
            NvmeIOError: the write failed (naming the file); RuntimeError: the store is unusable.
        """
        self._guard(self._write_behind, g, offset, values)
        self._guard(self._wait_writes, self._name(g))

    @torch.no_grad()
    def read_range(self, g: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of group ``g``'s partition as a new CPU tensor of the training dtype (after the
        writes behind to those bytes have landed)."""
        return self._guard(self._read_range, g, lo, hi)

    def _read_range(self, g: int, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=self.dtype)
        flat = out.view(torch.uint8)
        name = self._name(g)
        b_lo, b_hi = lo * self.itemsize, hi * self.itemsize
        pos = b_lo
        while pos < b_hi:
            start = _align_down(pos)
            stop = min(align_up(b_hi), start + self.window)
            end = min(b_hi, stop)
            win = self.ring[self._take_ring_buffer()].raw[:stop - start]
            self._wait_writes(name, start, stop)
            self.swapper.wait(self.swapper.read(name, win, start))
            flat[pos - b_lo:end - b_lo].copy_(win[pos - start:end - start])
            pos = end
        return out

    def close(self) -> None:
        """Wait for outstanding I/O (the writes behind included) and delete the files (also at collection and
        at exit)."""
        self._finalizer()
