"""Stage-3 parameters on NVMe (offload_param.device = nvme): exactness against plain AdamW with the optimizer
states on NVMe or in host memory, world sizes 1 and 2, accumulation 1 and 3; the parameter store alone
(bit-exact unaligned writes, read-ahead bounded by max_in_cpu, ENOSPC naming the file); host memory of
parameters bounded by the pool; the config errors; swap files reclaimed at start and removed at exit."""
import errno
import gc
import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import zero_offload
from dist_utils import run_ranks
from reference import engine_config, engine_runs, reference_run
from tmpfs_utils import small_tmpfs
from toy_model import make_model
from zero_offload.config import ConfigError
from zero_offload.nvme import NvmeIOError
from zero_offload.nvme import param_store
from zero_offload.nvme.param_store import NvmeParamStore

CASES = list(itertools.product(("nvme", "cpu"), (1, 3)))   # (offload_optimizer.device, gas)
ATOL = 1e-5


def param_nvme_config(path, optimizer, gas, ws, buffer_count=3, max_in_cpu=10_000):
    cfg = engine_config(3, optimizer, gas, ws=ws, sub_group_size=3000, stage3_param_persistence_threshold=0)
    if optimizer == "nvme":
        cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(path), buffer_count=3,
                                                             pipeline_read=True, pipeline_write=True)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(path),
                                                 "buffer_count": buffer_count, "buffer_size": 10_000,
                                                 "max_in_cpu": max_in_cpu}
    cfg["aio"] = {"block_size": 8192, "intra_op_parallelism": 2}
    return cfg


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("nvme_params")
    out = {}
    for ws in (1, 2):
        configs = [param_nvme_config(path, *case, ws=ws) for case in CASES]
        per_case = engine_runs(configs) if ws == 1 else run_ranks(engine_runs, 2, configs)[0]
        out.update({(ws, *case): res for case, res in zip(CASES, per_case)})
    return out, path


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("optimizer,gas", CASES)
def test_params_on_nvme_match_adamw(results, ws, optimizer, gas):
    """5 steps; the parameters (read back through the files) and the masters match plain AdamW to 1e-5."""
    ref_params, ref_losses = reference_run(gas=gas, ws=ws)
    masters, params, losses = results[0][(ws, optimizer, gas)]
    for name, ref in ref_params.items():
        assert (masters[name] - ref).abs().max().item() <= ATOL, name
        assert (params[name] - ref).abs().max().item() <= ATOL, name
    assert losses == pytest.approx(ref_losses, abs=1e-5)


def test_param_swap_files_are_removed(results):
    gc.collect()
    left = [p for p in results[1].rglob("*") if p.is_file()]
    assert left == [], left


# -- the store alone ------------------------------------------------------------------------------------
def _units(sizes):
    units, offset = [], 0
    for i, n in enumerate(sizes):
        units.append(SimpleNamespace(index=i, group=0, partition_offset=offset, shard_numel=n))
        offset += n
    return units, offset


def test_store_round_trip_is_bit_exact_and_read_ahead_is_bounded(tmp_path):
    """Unaligned shards (odd sizes, bf16) written one by one and as one range read back bit for bit through
    acquire (pool buffers) and read_range; read-ahead stops at max_in_cpu and at the pool's size."""
    units, total = _units([1, 3000, 2047, 5, 4096, 999])
    store = NvmeParamStore([total], units, torch.bfloat16, tmp_path / "swap", buffer_count=3, buffer_size=4096,
                           max_in_cpu=5000)
    values = torch.randn(total).to(torch.bfloat16)
    for u in reversed(units):          # out of order: every write reads its neighbours' shared blocks
        store.write_shard(u, values[u.partition_offset:u.partition_offset + u.shard_numel])
    assert torch.equal(store.read_range(0, 0, total).view(torch.int16), values.view(torch.int16))
    assert store.prefetch(units[0]) and store.prefetch(units[1])      # 3001 elements
    assert not store.prefetch(units[2])                              # 3001 + 2047 > max_in_cpu
    assert store.prefetch(units[3])                                  # the third buffer
    assert not store.prefetch(units[5])                              # no buffer left
    for u in units:                    # acquire evicts read-ahead that is in the way
        got = store.acquire(u)
        assert torch.equal(got.view(torch.int16),
                           values[u.partition_offset:u.partition_offset + u.shard_numel].view(torch.int16))
        store.release(u)
    assert store.shards_read_ahead == 3 and store.shards_read_on_demand == 3
    new = torch.randn(total).to(torch.bfloat16)
    store.write_range(0, 0, new)
    assert torch.equal(store.acquire(units[4]).view(torch.int16),
                       new[units[4].partition_offset:units[4].partition_offset + 4096].view(torch.int16))
    store.close()
    assert not (tmp_path / "swap").exists()


def test_store_refuses_a_unit_larger_than_buffer_size(tmp_path):
    units, total = _units([100, 5000])
    with pytest.raises(ValueError, match=r"'zero_optimization.offload_param.buffer_size' = 4096: the largest unit "
                                         r"partition has 5000 elements; set buffer_size >= 5000"):
        NvmeParamStore([total], units, torch.float16, tmp_path, buffer_count=2, buffer_size=4096, max_in_cpu=10)


def test_enospc_on_the_param_file_names_it_and_stops(tmp_path):
    """A disk that fills up: the write raises NvmeIOError(ENOSPC) naming the parameter file, and every later
    access raises at once instead of gathering half-written parameters."""
    with small_tmpfs(tmp_path / "small", "64k") as small:
        units, total = _units([20_000])
        store = NvmeParamStore([total], units, torch.float16, small, buffer_count=1, buffer_size=20_000,
                               max_in_cpu=20_000)
        (small / "filler").write_bytes(b"\0" * (40 << 10))       # leaves ~24 KiB for a 40 KB file
        with pytest.raises(NvmeIOError) as info:
            store.write_range(0, 0, torch.ones(total, dtype=torch.float16))
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename.endswith("group0.param.swp")
        with pytest.raises(RuntimeError, match="unusable after an earlier I/O error"):
            store.acquire(units[0])
        store.close()


# -- the engine --------------------------------------------------------------------------------------------
class Stack(torch.nn.Module):
    """Sixteen 512 x 512 linear layers: 4.2M parameters, 16.8 MB of fp32 partition."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(16))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return ((x - y) ** 2).mean()


def _live_cpu_bytes() -> int:
    """Bytes of every distinct CPU tensor storage alive in this process."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            try:
                ptr = storage.data_ptr()
            except RuntimeError:          # a fake tensor an earlier torch.compile left in dynamo's caches: no memory
                continue
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


def _measure(config, steps=3):
    """Train 3 steps (in a fresh forked process: nothing of another engine is alive) and measure."""
    torch.manual_seed(0)
    engine = zero_offload.initialize(Stack(), config)
    x, y = torch.randn(4, 512), torch.randn(4, 512)
    for _ in range(steps):
        engine.backward(engine(x, y))
        engine.step()
    store = getattr(engine.zero, "store", None)
    return {"live": _live_cpu_bytes(), "mem": engine.memory_breakdown(),
            "pool": sum(t.numel() for t in store.tensors()) if not store.resident else 0,
            "read_ahead": getattr(store, "shards_read_ahead", 0), "peak": getattr(store, "peak_resident_numel", 0)}


def test_host_memory_of_parameters_is_the_pool(tmp_path, monkeypatch):
    """Same model and optimizer states on NVMe, parameters on cpu vs nvme: the live CPU tensors of the nvme
    run are those of the cpu run less the whole partition plus the store's read pool and write ring (+64 KiB
    of slack); the shards of the replayed steps were read ahead in the recorded order, never more than
    max_in_cpu at once."""
    def config(param_device):
        cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1 << 16,
                                     "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                                     "offload_param": {"device": param_device}}}
        if param_device == "nvme":
            cfg["zero_optimization"]["offload_param"].update(nvme_path=str(tmp_path), buffer_count=3,
                                                             buffer_size=1 << 19, max_in_cpu=1 << 20)
        return cfg

    monkeypatch.setattr(param_store, "WRITE_WINDOW", 1 << 20)     # a 4 MiB ring: small beside this partition
    cpu = run_ranks(_measure, 1, config("cpu"))[0]
    nvme = run_ranks(_measure, 1, config("nvme"))[0]
    partition, pool = cpu["mem"]["params"]["bytes"], nvme["mem"]["param_pool"]["bytes"]
    ring = nvme["mem"]["param_write_ring"]["bytes"]
    assert nvme["mem"]["params"]["side"] == "nvme" and nvme["mem"]["params"]["bytes"] >= partition
    assert pool == nvme["pool"] and partition > 2 * pool       # the pool is far smaller than the partition
    assert ring == 4 << 20 and partition > 2 * ring
    assert nvme["live"] <= cpu["live"] - partition + pool + ring + (64 << 10), (nvme["live"], cpu["live"])
    assert nvme["read_ahead"] >= 2 * 15 and nvme["peak"] <= (1 << 20) + 512 * 513


def test_bad_param_nvme_config_names_the_key(tmp_path):
    cfg = param_nvme_config(tmp_path, "cpu", 1, 1)
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = 100
    with pytest.raises(ConfigError, match=r"'zero_optimization.offload_param.buffer_size' = 100: the largest unit "
                                          r"partition has \d+ elements; set buffer_size >= \d+"):
        zero_offload.initialize(make_model(), cfg)
    cfg = param_nvme_config(tmp_path / "nope", "cpu", 1, 1)
    with pytest.raises(ConfigError, match=r"'zero_optimization.offload_param.nvme_path' = '.*nope'.*does not exist"):
        zero_offload.initialize(make_model(), cfg)
    cfg = param_nvme_config(tmp_path, "cpu", 1, 1)
    del cfg["zero_optimization"]["offload_param"]["nvme_path"]
    with pytest.raises(ConfigError, match=r"'zero_optimization.offload_param.nvme_path' is required"):
        zero_offload.Config.load(cfg)
    cfg = param_nvme_config(tmp_path, "cpu", 1, 1)
    cfg["zero_optimization"]["offload_optimizer"]["delayed_param_update"] = True
    with pytest.raises(ConfigError, match="delayed_param_update' = true needs the parameters in memory"):
        zero_offload.Config.load(cfg)


def test_free_space_counts_parameter_and_optimizer_files(tmp_path):
    with small_tmpfs(tmp_path / "small", "96k") as small:
        with pytest.raises(ConfigError) as info:
            zero_offload.initialize(make_model(), param_nvme_config(small, "nvme", 1, 1))
    msg = str(info.value)
    assert "'zero_optimization.offload_param.nvme_path'" in msg
    assert "16-bit parameters (" in msg and "optimizer states (" in msg and "bytes are free" in msg


EXIT_SCRIPT = textwrap.dedent(r"""
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import zero_offload
    from test_nvme_params import param_nvme_config
    from toy_model import make_model
    engine = zero_offload.initialize(make_model(), param_nvme_config(sys.argv[1], "nvme", 1, 1))
    print(sorted(p.name for p in (Path(sys.argv[1]) / "zero_offload" / "rank0").iterdir()))   # the swap files
""")


def test_stale_files_reclaimed_at_start_and_removed_at_exit(tmp_path):
    """A killed run's parameter and state files are replaced at the next start; a process that exits without
    closing anything leaves no files behind."""
    rank_dir = tmp_path / "zero_offload" / "rank0"
    rank_dir.mkdir(parents=True)
    for name in ("group0.param.swp", "group0.master.swp", "group0.exp_avg.swp"):
        (rank_dir / name).write_bytes(b"stale" * 200_000)
    tests = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path), tests], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    names = json.loads(proc.stdout.strip().splitlines()[-1].replace("'", '"'))
    assert names == ["group0.exp_avg.swp", "group0.exp_avg_sq.swp", "group0.master.swp", "group0.param.swp"]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_checkpoint_from_host_loads_into_param_nvme_with_reshard(tmp_path):
    """Stage 3: saved by 2 ranks with parameters and states in host memory, loaded by 1 (2 accumulation
    steps: the same global batch) with both on NVMe (the load writes the parameter files); 2 more steps give
    the parameters of 5 uninterrupted steps of plain AdamW. (nvme -> cpu at stage 2: test_nvme_checkpoint_errors;
    the streamed save of NVMe state: test_nvme_checkpoint_memory.)"""
    save_nvme = False
    from test_checkpoint import _phase_resume, _phase_save, _run
    (tmp_path / "swap").mkdir()

    def config(ws, gas, nvme):
        if nvme:
            return param_nvme_config(tmp_path / "swap", "nvme", gas, ws)
        cfg = engine_config(3, "cpu", gas, ws=ws)
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        return cfg

    _run(2, _phase_save, config(2, 1, save_nvme), tmp_path / "ckpt", 3)
    resumed, _ = _run(1, _phase_resume, config(1, 2, not save_nvme), tmp_path / "ckpt", 2, 3)
    ref, _ = reference_run(gas=2, ws=1, steps=5)
    for name, value in ref.items():
        assert (resumed[name] - value).abs().max().item() <= ATOL, name


@pytest.mark.parametrize("optimizer", ["nvme", "cpu"])
def test_gathered_parameters_write_back_reaches_the_file_and_the_master(tmp_path, optimizer):
    """``gathered_parameters(..., modifier_rank=0)`` under offload_param nvme: the written values are in the
    parameter file (seen by the next gather) and in the fp32 master weights (in their swap file or in host
    memory)."""
    engine = zero_offload.initialize(make_model(), param_nvme_config(tmp_path, optimizer, 1, 1))
    w = engine.module.blocks[0].fc.weight
    with zero_offload.gathered_parameters(w, modifier_rank=0):
        w.data.fill_(0.5)
    with zero_offload.gathered_parameters(w):
        assert torch.equal(w, torch.full_like(w, 0.5))
        shape = tuple(w.shape)
    assert torch.equal(engine.full_state_dict()["blocks.0.fc.weight"], torch.full(shape, 0.5))
