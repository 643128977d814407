"""Stage-3 parameter writes behind the step (offload_param.device = nvme): `NvmeParamStore.write_behind` returns
with its writes in flight through a 4-buffer ring; a later read of the same bytes (the next forward's fetch,
read_range) waits for them and sees the new values, bit for bit; the engine's step returns with the parameter
writes still in flight (both optimizer placements) and the next forward waits for them and computes plain
AdamW's loss; a write that fails behind the step (ENOSPC) raises NvmeIOError naming the file at the next
forward, and the engine stops there."""
import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

import zero_offload
from reference import MICRO, reference_run
from test_nvme_params import _units, param_nvme_config
from tmpfs_utils import small_tmpfs
from toy_model import batch, make_model
from zero_offload.nvme import NvmeIOError
from zero_offload.nvme import param_store
from zero_offload.nvme.param_store import WRITE_RING, NvmeParamStore


def test_write_behind_goes_through_the_ring_and_reads_wait_for_it(tmp_path, monkeypatch):
    """An unaligned bf16 range of 5 MB (more than a ring of 1 MiB windows: buffers are reused) written behind,
    then an overlapping range written behind while the first is still outstanding; read_range and acquire return the
    newest bits, and nothing is left outstanding after them."""
    monkeypatch.setattr(param_store, "WRITE_WINDOW", 1 << 20)     # small windows: the ring wraps at this size
    units, total = _units([1, 1_000_000, 1_500_001, 3, 999])
    store = NvmeParamStore([total], units, torch.bfloat16, tmp_path / "swap", buffer_count=2,
                           buffer_size=1_500_001, max_in_cpu=total)
    values = torch.randn(total).to(torch.bfloat16)
    store.write_behind(0, 1, values[1:])
    assert 0 < store.pending_writes <= WRITE_RING
    newer = torch.randn(1_000_000)                                 # fp32, rounded on the way
    store.write_behind(0, 3, newer)
    values[3:1_000_003] = newer.to(torch.bfloat16)
    got = store.acquire(units[2])
    want = values[units[2].partition_offset:units[2].partition_offset + units[2].shard_numel]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    store.release(units[2])
    assert torch.equal(store.read_range(0, 1, total).view(torch.int16), values[1:].view(torch.int16))
    store.flush()
    assert store.pending_writes == 0
    store.close()


def test_a_failed_write_behind_raises_at_the_next_read_and_stops(tmp_path):
    """A full disk: write_behind returns (the write is behind), the next read of those bytes raises
    NvmeIOError(ENOSPC) naming the parameter file, and every later access raises at once."""
    with small_tmpfs(tmp_path / "small", "64k") as small:
        units, total = _units([20_000])
        store = NvmeParamStore([total], units, torch.float16, small, buffer_count=1, buffer_size=20_000,
                               max_in_cpu=20_000)
        (small / "filler").write_bytes(b"\0" * (40 << 10))       # leaves ~24 KiB for a 40 KB file
        store.write_behind(0, 0, torch.ones(total, dtype=torch.float16))
        assert store.pending_writes == 1
        with pytest.raises(NvmeIOError) as info:
            store.acquire(units[0])
        assert info.value.errno == errno.ENOSPC and info.value.filename.endswith("group0.param.swp")
        with pytest.raises(RuntimeError, match="unusable after an earlier I/O error"):
            store.read_range(0, 0, 10)
        store.close()


class HeldWrites:
    """The store's swapper with its writes held back, as on a slow disk: a write starts on a worker thread only
    once someone waits for it (in issue order), so `done()` tells whether the store waited yet."""

    def __init__(self, inner):
        self.inner, self.waited = inner, 0
        self.held: list[Future] = []
        self.gate = ThreadPoolExecutor(1)
        self.release = Future()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, name, src, offset=0):
        self.held.append(self.gate.submit(self._write, name, src, offset))
        return self.held[-1]

    def _write(self, name, src, offset):
        self.release.result(timeout=120)         # never hang the run if a test fails before waiting
        self.inner.wait(self.inner.write(name, src, offset))

    def wait(self, pending):
        if not isinstance(pending, Future):
            return self.inner.wait(pending)
        self.waited += 1
        if not self.release.done():
            self.release.set_result(True)
        pending.result()


@pytest.mark.parametrize("optimizer", ["nvme", "cpu"])
def test_step_returns_with_parameter_writes_in_flight(tmp_path, optimizer):
    """After step() the updated parameters' writes are outstanding (held, none waited for); the next forward
    waits for them and gives plain AdamW's loss of step 2, so it read the new values."""
    cfg = param_nvme_config(tmp_path, optimizer, 1, 1)
    cfg["zero_optimization"]["sub_group_size"] = 1 << 20          # one sub-group per group: within the ring
    engine = zero_offload.initialize(make_model(), cfg)
    store = engine.zero.store
    held = store.swapper = HeldWrites(store.swapper)
    x, y = batch(0, MICRO)
    engine.backward(engine(x, y))
    engine.step()
    assert held.held and not any(f.done() for f in held.held) and held.waited == 0
    assert store.pending_writes == len(held.held)
    x, y = batch(1, MICRO)
    loss = engine(x, y)
    assert held.waited >= 1 and all(f.done() for f in held.held)
    assert loss.item() == pytest.approx(reference_run(steps=2)[1][1], abs=1e-5)
    store.swapper = held.inner
    engine.zero.store.close()


def test_engine_stops_after_a_failed_parameter_write_behind(tmp_path):
    """The parameter files lose their blocks and the disk fills: step() returns, the next forward raises
    NvmeIOError(ENOSPC) naming a parameter file, and the forward after it raises that the files are unusable."""
    with small_tmpfs(tmp_path / "small", "512k") as small:
        engine = zero_offload.initialize(make_model(), param_nvme_config(small, "cpu", 1, 1))
        store = engine.zero.store
        x, y = batch(0, MICRO)
        engine.backward(engine(x, y))
        for f in store.swapper.files.values():             # free the blocks: the next write must allocate
            os.truncate(f.path, 0)
            os.truncate(f.path, f.nbytes)
        with open(small / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        engine.step()
        assert store.pending_writes > 0
        with pytest.raises(NvmeIOError) as info:
            engine(x, y)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename.startswith(str(small / "zero_offload" / "rank0" / "group"))
        assert info.value.filename.endswith(".param.swp")
        with pytest.raises(RuntimeError, match="NVMe parameter files are unusable after an earlier I/O error"):
            engine(x, y)
        store.close()
