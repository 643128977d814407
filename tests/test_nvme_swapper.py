"""The NVMe I/O layer alone: bit-for-bit round trips, O_DIRECT and its fallback, disk errors naming the file."""
import errno
import os
import subprocess
import threading
import warnings

import pytest
import torch

from zero_offload.nvme import AlignedBuffer, BufferPool, NvmeIOError, Swapper
from zero_offload.nvme import _native
from zero_offload.nvme import swapper as swapper_mod

# Both submission paths: the native AIO one (where built) and the portable preadv/pwritev one.
PATHS = pytest.mark.parametrize("native", [True, False], ids=["native", "portable"])


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (we run as root in CI); skipped with the reason where mounting is not allowed."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to provoke ENOSPC: {r.stderr.strip() or r.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(tmp_path, dtype, native):
    s = Swapper(tmp_path, block_size=8192, thread_count=3, queue_depth=2, native=native)
    numel = 3 * 8192 // torch.empty(0, dtype=dtype).element_size() + 1024   # pieces of unequal size
    src, dst = AlignedBuffer(numel * 4), AlignedBuffer(numel * 4)
    x = src.view(dtype, numel)
    x.copy_(torch.randn(numel).to(dtype))
    x.view(torch.int16 if x.element_size() == 2 else torch.int32)[:7] = -1   # NaN bit patterns survive too
    s.open("state", 2 * src.nbytes)
    s.write("state", src.raw, offset=src.nbytes)
    s.flush()
    s.wait(s.read("state", dst.raw, offset=src.nbytes))
    assert torch.equal(dst.raw, src.raw)
    s.wait(s.read("state", dst.raw, offset=0))       # never written: sparse, reads as zeros
    assert not dst.raw.any()
    assert s.bytes_written == src.nbytes and s.bytes_read == 2 * src.nbytes
    path = s.files["state"].path
    s.close()
    assert not path.exists()
    s.close()                                          # twice is fine


def test_direct_io_where_the_filesystem_allows_it(tmp_path):
    s = Swapper(tmp_path)
    f = s.open("a", 4096)
    probe = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    os.close(probe)
    assert f.direct == bool(getattr(os, "O_DIRECT", 0))
    misaligned = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="aligned"):
        s.read("a", misaligned)
    s.close()


@PATHS
def test_buffered_fallback_warns_once(tmp_path, monkeypatch, native):
    monkeypatch.setattr(Swapper, "_probe_direct", staticmethod(lambda fd: False))
    s = Swapper(tmp_path, native=native)
    with pytest.warns(RuntimeWarning, match="O_DIRECT"):
        a = s.open("a", 8192)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = s.open("b", 8192)
    assert not a.direct and not b.direct
    src = torch.arange(100, dtype=torch.float32)         # unaligned tensors are fine without O_DIRECT
    s.write("b", src, offset=4)
    dst = torch.empty(100, dtype=torch.float32)
    s.flush()
    s.wait(s.read("b", dst, offset=4))
    assert torch.equal(src, dst)
    s.close()


@PATHS
def test_enospc_names_the_file(small_tmpfs, native):
    s = Swapper(small_tmpfs, block_size=1 << 16, queue_depth=4, native=native)
    s.open("exp_avg.swp", 4 << 20)                       # sparse: 4 MiB announced on a 1 MiB filesystem
    buf = AlignedBuffer(2 << 20)
    pending = s.write("exp_avg.swp", buf.raw)
    with pytest.raises(NvmeIOError) as info:
        s.wait(pending)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(small_tmpfs / "exp_avg.swp")
    assert "exp_avg.swp" in str(info.value)
    s.close()
    assert not (small_tmpfs / "exp_avg.swp").exists()


def test_eio_names_the_file(tmp_path, monkeypatch):
    s = Swapper(tmp_path, native=False)
    s.open("master.swp", 8192)

    def failing(*_args):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(swapper_mod.os, "preadv", failing)
    with pytest.raises(NvmeIOError, match="master.swp") as info:
        s.wait(s.read("master.swp", AlignedBuffer(8192).raw))
    assert info.value.errno == errno.EIO
    monkeypatch.undo()
    s.close()


@pytest.mark.skipif(not _native.available(), reason="native AIO path not built")
def test_native_eio_names_the_file(tmp_path, monkeypatch):
    s = Swapper(tmp_path, native=True)
    s.open("exp_avg_sq.swp", 8192)
    monkeypatch.setattr(swapper_mod._native, "transfer", lambda *_args: -errno.EIO)
    with pytest.raises(NvmeIOError, match="exp_avg_sq.swp") as info:
        s.wait(s.write("exp_avg_sq.swp", AlignedBuffer(8192).raw))
    assert info.value.errno == errno.EIO
    s.close()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="native AIO is Linux only")
def test_native_path_is_built_and_splits_requests_per_thread(tmp_path):
    """On Linux the install builds the AIO library (a silent build failure would hide here); a request is
    one part per I/O thread, and a read past a file that shrank under it fills the rest with zeros."""
    assert _native.available(), "zero_offload/nvme/_native/_aio was not built at install"
    s = Swapper(tmp_path, block_size=8192, thread_count=3, queue_depth=2)
    assert s.native
    s.open("f", 5 * 8192)
    src = AlignedBuffer(5 * 8192)
    src.raw.random_(1, 255)
    pending = s.write("f", src.raw)
    assert len(pending.futures) == 3                    # 2 + 2 + 1 blocks
    s.wait(pending)
    os.ftruncate(s.files["f"].fd, 3 * 8192)
    dst = AlignedBuffer(5 * 8192)
    dst.raw.fill_(7)
    s.wait(s.read("f", dst.raw))
    assert torch.equal(dst.raw[:3 * 8192], src.raw[:3 * 8192]) and not dst.raw[3 * 8192:].any()
    s.close()


def test_pool_round_robin_and_bounds():
    pool = BufferPool(3, 5000)
    assert [pool.next()[0] for _ in range(4)] == [0, 1, 2, 0]
    assert pool.nbytes == 3 * 8192
    assert all(b.raw.data_ptr() % 4096 == 0 for b in pool.buffers)
    with pytest.raises(ValueError, match="exceeds"):
        pool.buffers[0].view(torch.float32, 3000)


def test_both_partition_optimizers_fill_the_role(tmp_path):
    from zero_offload.hoststep.nvme_adam import NvmeAdam
    from zero_offload.offload.copies import make_copies
    from zero_offload.hoststep.role import PartitionOptimizer
    from zero_offload.hoststep.adam import PartitionedAdam
    hp = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "adamw_mode": True,
          "bias_correction": True}
    copies = make_copies(torch.device("cpu"))
    part = torch.randn(5000)
    nvme = NvmeAdam([part], [hp], copies, tmp_path / "r0", 2048, 3, True, True, block_size=4096)
    assert isinstance(nvme, PartitionOptimizer)
    assert isinstance(PartitionedAdam([part.clone()], [hp], True, False, copies), PartitionOptimizer)
    assert torch.equal(nvme.masters[0], part)            # masters read back from the files, bit for bit
    nvme.close()
    assert not (tmp_path / "r0").exists()


def test_a_swapper_closed_late_leaves_the_directory_another_one_is_filling(tmp_path):
    """An engine collected late (its swapper closing from a finalizer) while a new engine's swapper, on the same
    swap directory, has opened no file yet: the directory stays until its last swapper closes. Power: the old rule
    (remove the directory whenever it is empty) makes the new swapper's first open fail with ENOENT."""
    directory = tmp_path / "rank0"
    old, new = Swapper(directory), Swapper(directory)
    old.close()
    assert directory.is_dir()
    new.open("group0.param.swp", 4096)
    new.close()
    assert not directory.exists()


def test_power_removing_an_empty_directory_in_use_breaks_the_next_open(tmp_path, monkeypatch):
    directory = tmp_path / "rank0"
    monkeypatch.setattr(swapper_mod, "_LIVE", {})
    old, new = Swapper(directory), Swapper(directory)
    swapper_mod._LIVE.clear()          # as if nothing held it: the old rule
    swapper_mod._LIVE[old._key] = 1
    old.close()
    with pytest.raises(NvmeIOError, match="No such file"):
        new.open("group0.param.swp", 4096)
    swapper_mod._LIVE[new._key] = 1
    new.close()


@PATHS
def test_a_forked_childs_copy_closes_at_once_and_keeps_the_parents_file(tmp_path, native):
    """A process forked while a write is in flight holds a copy of the swapper (its garbage collector closes one
    the parent had not yet collected). Closing the copy returns at once and deletes nothing; the parent's write
    completes. Power: the parent's close run in the child waits for a request whose I/O thread is not there
    (the hang of a 2-rank NVMe test whose ranks forked from a process with an engine left to collect)."""
    s = Swapper(tmp_path, block_size=8192, native=native)
    src = AlignedBuffer(8192)
    src.view(torch.float32, 2048).fill_(3.0)
    s.open("state", src.nbytes)
    gate = threading.Event()
    for pool in set(s.pools.values()):
        pool.submit(gate.wait)                    # the one I/O thread is busy: the write below stays in flight
    pending = s.write("state", src.view(torch.float32, 2048))
    pid = os.fork()
    if pid == 0:                                  # the child: only os calls and a thread, then os._exit
        closing = threading.Thread(target=s.close, daemon=True)
        closing.start()
        closing.join(timeout=10)
        os._exit(0 if not closing.is_alive() and (tmp_path / "state").exists() else 1)
    _, status = os.waitpid(pid, 0)
    gate.set()
    s.wait(pending)
    dst = AlignedBuffer(8192)
    s.wait(s.read("state", dst.view(torch.float32, 2048)))
    s.close()
    assert os.waitstatus_to_exitcode(status) == 0, "the child's close waited or deleted the parent's file"
    assert torch.equal(dst.view(torch.float32, 2048), torch.full((2048,), 3.0))
