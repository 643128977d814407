"""NVMe offload: checkpoints across nvme and cpu offload with a 2 -> 1 reshard, and every bad input."""
import errno
import hashlib
import subprocess

import pytest
import zero_offload
from reference import MICRO, engine_config, reference_run
from test_checkpoint import _phase_resume, _phase_save, _run
from toy_model import batch, make_model
from zero_offload.config import ConfigError
from zero_offload.nvme import NvmeIOError


def nvme(cfg, path, sub=4096):
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path),
                                                     "pipeline_read": True, "pipeline_write": True}
    cfg["zero_optimization"]["sub_group_size"] = sub
    return cfg


def mount_tmpfs(path, size="1m", ro=False):
    path.mkdir()
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip() or r.returncode}")
    return path


@pytest.fixture
def mounts():
    mounted = []
    yield lambda *a, **k: mounted.append(mount_tmpfs(*a, **k)) or mounted[-1]
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], check=False)


@pytest.mark.parametrize("save_off,load_off", [("nvme", "cpu"), ("cpu", "nvme")])
def test_checkpoint_between_nvme_and_cpu_with_reshard(tmp_path, save_off, load_off):
    """Saved by 2 ranks at stage 2, loaded by 1 (2 accumulation steps: the same global batch), then 2 more
    steps: the same parameters as 5 uninterrupted steps of plain AdamW."""
    swap = tmp_path / "swap"
    swap.mkdir()
    cfg_a, cfg_b = engine_config(2, "cpu", 1, ws=2), engine_config(2, "cpu", 2, ws=1)
    cfg_a = nvme(cfg_a, swap) if save_off == "nvme" else cfg_a
    cfg_b = nvme(cfg_b, swap) if load_off == "nvme" else cfg_b
    _run(2, _phase_save, cfg_a, tmp_path / "ckpt", 3)
    resumed, _ = _run(1, _phase_resume, cfg_b, tmp_path / "ckpt", 2, 3)
    ref, _ = reference_run(gas=2, ws=1, steps=5)
    for name, value in ref.items():
        assert (resumed[name] - value).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("zero,message", [
    ({"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
     "'zero_optimization.offload_optimizer.device' = 'nvme' needs 'zero_optimization.stage' 2 or 3 (got 1)"),
    ({"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "needs 'zero_optimization.stage'"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}},
     "'zero_optimization.offload_optimizer.nvme_path' is required"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 2,
                                        "pipeline_read": True, "pipeline_write": True}},
     "'zero_optimization.offload_optimizer.buffer_count': got 2, needs >= 3"),
    ({"stage": 2, "sub_group_size": 0}, "'zero_optimization.sub_group_size': got 0, must be >= 1"),
])
def test_bad_nvme_config_names_the_key(zero, message):
    with pytest.raises(ConfigError) as info:
        zero_offload.Config.load({"train_batch_size": 2, "zero_optimization": zero})
    assert message in str(info.value)


@pytest.mark.parametrize("aio,message", [
    ({"use_gds": True}, "'aio.use_gds': True is accepted by DeepSpeed but not implemented"),
    ({"block_size": 5000}, "'aio.block_size': got 5000, must be a multiple of 4096"),
    ({"intra_op_parallelism": 0}, "'aio.intra_op_parallelism': got 0, must be >= 1"),
    ({"queue_dept": 8}, "did you mean 'queue_depth'"),
])
def test_bad_aio_block_names_the_key(aio, message):
    with pytest.raises(ConfigError) as info:
        zero_offload.Config.load({"train_batch_size": 2, "aio": aio})
    assert message in str(info.value)


def test_aio_defaults_are_deepspeeds():
    aio = zero_offload.Config.load({"train_batch_size": 2}).aio
    assert (aio.block_size, aio.queue_depth, aio.intra_op_parallelism, aio.single_submit, aio.overlap_events,
            aio.use_gds) == (1048576, 8, 1, False, True, False)
    assert zero_offload.Config.load({"train_batch_size": 2, "aio": {"thread_count": 3}}).aio.threads == 3
    oo = zero_offload.Config.load({"train_batch_size": 2}).zero_optimization.offload_optimizer
    assert (oo.buffer_count, oo.pipeline_read, oo.pipeline_write, oo.fast_init) == (4, False, False, False)


def _init(path, stage=2):
    return zero_offload.initialize(make_model(), nvme(engine_config(stage, "cpu", 1), path))


def test_nvme_path_missing_or_not_a_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"'zero_optimization.offload_optimizer.nvme_path' = '.*nope'.*does not"):
        _init(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="nvme_path' = '.*file': not a directory"):
        _init(tmp_path / "file")


def test_nvme_path_unwritable(tmp_path, mounts):
    ro = mounts(tmp_path / "ro", ro=True)
    with pytest.raises(ConfigError, match="nvme_path' = '.*ro': not writable"):
        _init(ro)


def test_too_little_free_space_reports_both_numbers(tmp_path, mounts):
    small = mounts(tmp_path / "small", size="256k")
    need = 3 * 7 * 4096 * 4   # three fp32 states of the toy model's 27,136 elements: 7 sub-groups of 4096
    with pytest.raises(ConfigError) as info:
        _init(small)
    msg = str(info.value)
    assert "'zero_optimization.offload_optimizer.nvme_path'" in msg and f"needs {need:,} bytes" in msg
    assert "bytes are free" in msg


def _fill(directory):
    """Write a filler file until the filesystem is full."""
    block = b"\0" * 4096
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as e:
            assert e.errno == errno.ENOSPC


def _digests(root):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_enospc_mid_step_names_the_file_and_stops(tmp_path, mounts):
    disk = mounts(tmp_path / "disk", size="1m")
    engine = _init(disk)
    x, y = batch(0, MICRO)
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    saved = _digests(tmp_path / "ckpt")
    # The moments became real files in step 1; a new engine's moments are sparse: fill the disk under them.
    engine = _init(disk)
    _fill(disk)
    engine.backward(engine(x, y))
    with pytest.raises(NvmeIOError) as info:
        engine.step()
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename.startswith(str(disk / "zero_offload" / "rank0" / "group0."))
    assert info.value.filename in str(info.value)
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="unusable after an earlier I/O error"):
        engine.step()
    with pytest.raises(RuntimeError, match="unusable"):
        engine.save_checkpoint(tmp_path / "ckpt")
    assert _digests(tmp_path / "ckpt") == saved
    fresh = zero_offload.initialize(make_model(seed=7), engine_config(2, "cpu", 1))
    fresh.load_checkpoint(tmp_path / "ckpt")          # the last checkpoint still loads
    assert fresh.global_step == 1


def test_nvme_refuses_optimizers_without_adam_states(tmp_path):
    cfg = nvme(engine_config(2, "cpu", 1), tmp_path)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(ConfigError, match="'zero_optimization.offload_optimizer.device' = 'nvme'.*'SGD'"):
        zero_offload.initialize(make_model(), cfg)
