"""The planner and `zero-offload estimate`: choices in order of preference, bad input named clearly, and the
main job failing before any work when its config cannot fit."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import zero_offload
from zero_offload.cli import main
from zero_offload.estimate import estimate_memory, parse_bytes
from zero_offload.estimate.table import parse_size_flag
from zero_offload.zero.flat import ALIGNMENT, padded_numel, partition_numel

GiB = 2**30
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_partition_arithmetic_is_the_engines():
    assert padded_numel(1, 1) == ALIGNMENT
    assert padded_numel(ALIGNMENT * 2 + 1, 2) == ALIGNMENT * 4
    assert partition_numel([100, 20], 2) == padded_numel(120, 2) // 2 == ALIGNMENT
    # Estimates use it: 16-bit parameters of one padded flat buffer, 2 ranks.
    est = estimate_memory(10_000, {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                   "zero_optimization": {"stage": 1}}, world_size=2, accelerator=True)
    assert est.device["params"] == 2 * padded_numel(10_000, 2)
    assert est.device["exp_avg"] == 4 * partition_numel([10_000], 2)


def test_plan_prefers_the_lowest_stage_then_offload():
    # gpt2 (124M) on an 80 GB GPU: plain data parallelism.
    assert zero_offload.plan("gpt2", gpus=1, gpu_memory="80GB", host_memory="64GB", micro_batch=8,
                             gradient_accumulation=1).name == "stage 0"       # (the batch fixed: a shorter search)
    # 10B on one 80 GB GPU with 384 GB of host memory: the seed's ZeRO-Offload config.
    p = zero_offload.plan("gpt2-10b", gpus=1, gpu_memory="80GB", host_memory="384GB", seq_len=1024)
    assert p.name == "stage 2 + offload opt"
    assert p.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "stage 0" in p.reasons["rejected"]
    # A 24 GB GPU cannot hold the 16-bit parameters of 10B: stage 3 with parameters offloaded.
    p = zero_offload.plan("gpt2-10b", gpus=1, gpu_memory="24GB", host_memory="384GB", seq_len=1024)
    assert p.name == "stage 3 + offload opt+param"


def test_the_seeds_10b_model_fits_a_128gb_host_with_bf16_moments():
    # 14 host bytes/param (fp32 moments) is 134 GiB at 10.3B parameters: too much for 128 GB with headroom;
    # bf16 moments (10 B/param) fit, and the engine's estimate of them is what the plan reports.
    # bf16 moments change what is trained: only where allowed (issue 59), and the plan says so.
    exact = zero_offload.plan("gpt2-10b", gpus=1, gpu_memory="80GB", host_memory="128GB", seq_len=1024)
    assert not exact.fits and "--allow-bf16-moments" in next(r.error for r in exact.rows if "bf16 moments" in r.name)
    p = zero_offload.plan("gpt2-10b", gpus=1, gpu_memory="80GB", host_memory="128GB", seq_len=1024,
                          allow_bf16_moments=True)
    assert p.name == "stage 2 + offload opt, bf16 moments"
    assert p.reasons["precision"] == "bf16 moments: allowed (--allow-bf16-moments)"
    assert "stage 2 + offload opt" in p.reasons["rejected"]
    assert p.config["bf16"] == {"enabled": True, "bf16_optimizer_states": True}
    assert p.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    est = zero_offload.estimate_memory("gpt2-10b", p.config, 1, seq_len=1024, accelerator=True)
    assert 2 * est.host["exp_avg"] == 2 * est.host["exp_avg_sq"] == est.host["master"]   # bf16 vs fp32
    # Training in fp16 the bf16-moment rung is not offered.
    fp16 = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    p = zero_offload.plan("gpt2-10b", gpus=1, gpu_memory="80GB", host_memory="128GB", seq_len=1024, config=fp16,
                          allow_bf16_moments=True)
    assert "bf16 moments" not in (p.name or "")


def test_delayed_update_when_the_host_step_would_be_exposed_and_a_stale_step_is_allowed():
    from zero_offload.estimate.throughput import Assumptions, host_step_seconds
    kw = dict(gpus=1, gpu_memory="80GB", host_memory="384GB", seq_len=1024, gpu_flops=4e14, allow_stale_step=True)
    # 10B with fp32 moments on a 384 GB host: ~5.4 s of host step at 1.9 Gparam/s beside training; DPU hides it.
    host_adam = 1.9e9 / Assumptions().host_load_share
    p = zero_offload.plan("gpt2-10b", host_adam=host_adam, **kw)
    assert p.config["zero_optimization"]["offload_optimizer"]["delayed_param_update"] is True
    assert p.reasons["delayed_param_update"].startswith("on:")
    zero_offload.Config.load(p.config)        # the engine accepts the planned DPU config
    t = p.batch.timing           # 28 B/param (bf16 gradient, fp32 moments) at 1.9 Gparam/s x 28 B
    grad = 4 if p.batch.gas > 1 else 2
    assert abs(t.host_s - host_step_seconds(10_279_000_000, 4, grad, 2, 1.9e9)) < 1e-3 * t.host_s
    assert t.compute_s >= 0.9 * t.host_s and t.exposed_share <= 0.1
    # A host and copies fast enough that the step and its copies up hide in 10 % of the compute: no DPU. (Without
    # DPU the copies up follow the host step: at 25 GB/s they alone are 0.8 s, which DPU hides.)
    p = zero_offload.plan("gpt2-10b", host_adam=1e13, pcie=1e13, **kw)
    assert "delayed_param_update" not in p.config["zero_optimization"]["offload_optimizer"]
    assert p.reasons["delayed_param_update"].startswith("off: the host step hides")
    # Nothing offloaded (gpt2 fits the device): no DPU either.
    p = zero_offload.plan("gpt2", host_adam=1e6, **kw)
    assert "offload_optimizer" not in p.config["zero_optimization"]
    assert "delayed_param_update" not in p.reasons


def test_the_plan_is_exact_unless_a_stale_step_is_allowed():
    """The delayed update trains on parameters one step old: the plan never turns it on by itself. It predicts it
    still, and says what it would gain; allowed, the plan takes it where it is faster."""
    kw = dict(gpus=1, gpu_memory="80GB", host_memory="128GB", seq_len=1024,       # the seed's demo machine
              allow_bf16_moments=True)
    exact = zero_offload.plan("gpt2-10b", **kw)
    assert exact.fits and not exact.batch.delayed
    assert "delayed_param_update" not in exact.config["zero_optimization"]["offload_optimizer"]
    note = exact.reasons["delayed_param_update"]
    assert note.startswith("off: exact by default") and "--allow-stale-step" in note
    stale = zero_offload.plan("gpt2-10b", allow_stale_step=True, **kw)
    assert stale.batch.delayed and stale.batch.timing.tokens_per_s > exact.batch.timing.tokens_per_s
    gain = stale.batch.timing.tokens_per_s / exact.batch.timing.tokens_per_s - 1
    assert f"{gain:+.0%}" in note
    # A config that asks for it gets it without the flag.
    asked = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_param_update": True}}}
    assert zero_offload.plan("gpt2-10b", config=asked, **kw).batch.delayed


def test_without_an_accelerator_the_lowest_stage_that_fits_wins():
    # The compute device is the host: offloading saves nothing and adds copies (bench_planner measured it).
    p = zero_offload.plan("tiny", gpus=1, gpu_memory=None, host_memory="24GiB")
    assert p.config["zero_optimization"]["stage"] == 0 and "offload_optimizer" not in p.config["zero_optimization"]
    # ... until host memory runs short: then partitioning across 2 ranks comes before offloading anything.
    tight = zero_offload.plan("gpt2", gpus=2, gpu_memory=None, host_memory="4GiB", micro_batch=1, seq_len=256)
    assert tight.name == "stage 1" and "stage 0" in tight.reasons["rejected"]


def test_nothing_fits_says_how_much_is_missing_and_where():
    p = zero_offload.plan("gpt2-10b", gpus=1, gpu_memory="80GB", host_memory="32GB", seq_len=1024)
    assert not p.fits and p.config is None
    assert "the rows with bf16 optimizer states were not tried: they need --allow-bf16-masters and " \
           "--allow-bf16-moments" in p.message()
    p = zero_offload.plan("gpt2-10b", gpus=1, gpu_memory="80GB", host_memory="32GB", seq_len=1024,
                          allow_bf16_moments=True)
    # closest: ZeRO-Offload with bf16 moments and the gradient partition on the device (8 host bytes per
    # parameter, 76.7 GiB), short of host memory only
    assert set(p.missing) == {"host"} and p.missing["host"] > 45 * GiB
    message = p.message()
    assert "(stage 2 + offload opt, bf16 moments, grads on device) is missing" in message and "host memory" in message
    assert re.search(r"opt\+param, low live\) is missing [0-9.]+ GiB of host memory", message)


@pytest.mark.parametrize("kwargs,message", [
    (dict(model="gpt5"), "unknown model preset 'gpt5'"),
    (dict(model="gpt2", host_memory="-1GB"), "host_memory must be >= 0"),
    (dict(model="gpt2", gpu_memory="lots"), "gpu_memory: cannot read 'lots'"),
    (dict(model=0), "at least 1 parameter"),
    (dict(model="gpt2", gpus=0), "gpus must be an integer >= 1"),
])
def test_bad_plan_input(kwargs, message):
    args = dict(gpus=1, gpu_memory="80GB", host_memory="64GB") | kwargs
    with pytest.raises(ValueError, match=message):
        zero_offload.plan(args.pop("model"), **args)


def test_parse_bytes_units():
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("24GiB") == 24 * GiB and parse_bytes(512) == 512


def _cli(capsys, *argv):
    rc = main(["estimate", "--no-deepspeed", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_table_marks_the_plan_and_writes_it(tmp_path, capsys):
    target = tmp_path / "plan.json"
    rc, out, _ = _cli(capsys, "--model", "gpt2-10b", "--gpus", "1", "--gpu-mem", "80GB", "--host-mem", "384GB",
                      "--seq-len", "1024", "--write-config", str(target))
    assert rc == 0
    planned = [line for line in out.splitlines() if line.startswith("*")]
    assert len(planned) == 1 and "stage 2 + offload opt" in planned[0] and "yes" in planned[0]
    for name in ("stage 0", "stage 1", "stage 3 + offload opt+param"):
        assert name in out
    written = json.loads(target.read_text())
    zero_offload.Config.load(written)
    assert written["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    (["--hf-config", "/nonexistent/config.json"], "--hf-config /nonexistent/config.json: cannot read"),
    (["--host-mem=-4GB"], "--host-mem must be >= 0"),
    (["--params", "ten"], "--params: cannot read 'ten'"),
])
def test_cli_bad_input(capsys, argv, message):
    rc, _, err = _cli(capsys, *argv, "--gpu-mem", "80GB")
    assert rc == 2 and message in err


def test_cli_bare_size_is_gb(capsys):
    """Issue 20: `--gpu-mem 80` is 80 GB (it was read as 80 bytes), for every size flag, and --help says so."""
    sizes = ["--gpu-mem", "80", "--host-mem", "128", "--nvme", "2000"]
    rc, bare, _ = _cli(capsys, "--model", "gpt2-10b", "--gpus", "1", *sizes)
    rc_units, units, _ = _cli(capsys, "--model", "gpt2-10b", "--gpus", "1", "--gpu-mem", "80GB", "--host-mem",
                              "128GB", "--nvme", "2TB")
    measured = re.compile(r"~[0-9.]+ s at [0-9.]+ GB/s")     # the host step's time uses a measured bandwidth
    assert rc == rc_units and measured.sub("", bare) == measured.sub("", units)
    assert "x 74.5 GiB device, host 119.2 GiB, NVMe 1862.6 GiB" in bare.splitlines()[0]
    assert parse_size_flag("1.5", "--host-mem") == 1_500_000_000 and parse_size_flag("0", "--gpu-mem") == 0
    assert parse_size_flag("512B", "--nvme") == 512 and parse_size_flag("24GiB", "--gpu-mem") == 24 * GiB
    assert parse_bytes("80") == 80            # the Python API keeps reading a bare string as bytes
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--gpu-mem", "--host-mem", "--nvme"):
        assert re.search(flag + r" \S+ [^-]*a bare number of GB", text), flag


@pytest.mark.parametrize("argv,message", [
    (["--gpu-mem=-80"], "--gpu-mem must be >= 0, got '-80'"),
    (["--host-mem", "lots"], "--host-mem: cannot read 'lots' as a size"),
    (["--nvme", "2 TB of disk"], "--nvme: cannot read '2 TB of disk' as a size"),
])
def test_cli_bad_size_names_the_flag(capsys, argv, message):
    rc, _, err = _cli(capsys, "--model", "gpt2", *argv)
    assert rc == 2 and message in err


def test_cli_model_that_fits_nowhere(capsys):
    rc, out, _ = _cli(capsys, "--params", "1T", "--gpus", "1", "--gpu-mem", "80GB", "--host-mem", "64GB")
    assert rc == 1 and "nothing fits" in out and "missing" in out


def test_cli_hf_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 768, "num_hidden_layers": 12, "vocab_size": 50257,
                               "num_attention_heads": 12, "intermediate_size": 3072}))
    rc, out, _ = _cli(capsys, "--hf-config", str(cfg), "--gpu-mem", "80GB", "--host-mem", "64GB")
    # GPT-2 small without its position embeddings and biases: 123.6M.
    assert rc == 0 and "123.6M parameters" in out.splitlines()[0]


def test_train_that_cannot_fit_fails_before_any_work(tmp_path, capsys, monkeypatch):
    import zero_offload.train.planning as planning
    monkeypatch.setattr(planning, "_machine", lambda device: (0, 24 * GiB))   # this 24 GiB CPU box
    out_dir = tmp_path / "run"
    rc = main(["train", "--model", "gpt2-10b", "--config", str(CONFIGS / "ds_zero_offload.json"),
               "--seq-len", "1024", "--out", str(out_dir)])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit model gpt2-10b" in err and "zero-offload estimate" in err
    assert not out_dir.exists()          # no data prepared, nothing written


def test_every_shipped_config_loads():
    configs = sorted(CONFIGS.glob("*.json"))
    assert any(p.name == "ds_zero_offload.json" for p in configs)
    for path in configs:
        zero_offload.Config.load(str(path))


def test_sharded_build_initialises_like_gpt():
    """The main job builds large models under init_sharded and passes no param_init_fn: GPT's own
    initialisation (written by its __init__ into already-sharded children) gives a normal build's weights."""
    import math

    import torch

    from zero_offload.train.model import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=512, block_size=16, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    normal = GPT(cfg).state_dict()
    torch.manual_seed(0)
    with zero_offload.init_sharded():
        model = GPT(cfg)
    engine = zero_offload.initialize(model, {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam"},
                                             "zero_optimization": {"stage": 3}})
    state = engine.full_state_dict()
    for name, value in state.items():
        assert torch.equal(value, normal[name].float()), name
    residual = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert abs(state["transformer.h.1.mlp.c_proj.weight"].std().item() - residual) < 0.1 * residual
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g) for _ in range(2))
    _, loss = engine(x, y)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5     # an untrained GPT-2 starts near ln(V)


def test_nvme_without_a_path_is_planned_and_the_placeholder_named():
    """`plan(..., nvme="1TB")` with no ``nvme_path`` in the base config (as ``zero-offload estimate --nvme 1TB``
    asks): the NVMe rows were refused as configs ("nvme_path is required") and reported as not accepted by this
    build, so a 10B model on a 64 GB host did not fit. They are planned with DeepSpeed's example path, and the plan
    says it is a placeholder."""
    from zero_offload.estimate.planner import NVME_PATH_UNSET
    p = zero_offload.plan("gpt2-10b", 1, "139GB", "64GB", "1TB", timed=False)
    assert p.fits and "nvme" in p.name, p.message()
    assert p.config["zero_optimization"]["offload_optimizer"]["nvme_path"] == NVME_PATH_UNSET
    assert "placeholder" in p.reasons["nvme_path"] and "offload_optimizer.nvme_path" in p.reasons["nvme_path"]
    given = zero_offload.plan("gpt2-10b", 1, "139GB", "64GB", "1TB", timed=False, config={
        "zero_optimization": {"offload_optimizer": {"nvme_path": "/mnt/nvme0"}}})
    assert given.config["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/mnt/nvme0"
    assert "nvme_path" not in given.reasons


def test_a_plan_offloading_both_keeps_the_optimizers_keys_out_of_offload_param():
    """A row that offloads the optimizer and the parameters to the same device wrote one dict for both sections
    where the base config gave neither, so the batch choice's ``super_offload`` reached ``offload_param`` too (a key
    without effect there, warned about at every load); each section is its own now."""
    import warnings
    base = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        chosen = zero_offload.plan("gpt2-xl", 1, "6GB", "64GB", seq_len=1024, config=base)
    assert not [w for w in seen if "offload_param" in str(w.message)]
    zero = chosen.config["zero_optimization"]
    assert chosen.name.startswith("stage 3 + offload opt+param") and zero["offload_param"] == {"device": "cpu"}
