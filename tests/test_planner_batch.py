"""Issue 20, section 5: the memory model counts the delayed update's spare gradient partition and the gradient
staging of accumulation; the planner checks the fit with the delayed update on, and chooses the micro-batch,
gradient accumulation and activation checkpointing, saying how much of the step the host step leaves exposed."""
from __future__ import annotations

import re

import pytest

import zero_offload
from zero_offload.cli import main
from zero_offload.estimate import estimate_memory
from zero_offload.estimate.memory import default_plan_config
from zero_offload.estimate.throughput import Assumptions, accumulation_to_hide, step_timing
from zero_offload.zero.flat import padded_numel, partition_numel
from zero_offload.offload.grad_staging import STAGING_SLOTS, staging_shape, uses_grad_staging
from zero_offload.presets import gpt_units, preset

GiB = 2**30
SEED = dict(gpus=1, gpu_memory="80GB", host_memory="128GB")      # the seed's demo machine
XL = dict(gpus=1, gpu_memory="24GB", host_memory="64GB")


def _config(stage=2, gas=1, dpu=False, offload="cpu", offload_param=None, bucket=50_000_000):
    cfg = default_plan_config()
    cfg["gradient_accumulation_steps"] = gas
    zero = {"stage": stage, "reduce_bucket_size": bucket, "offload_optimizer": {"device": offload}}
    if dpu:
        zero["offload_optimizer"]["delayed_param_update"] = True
    if offload_param:
        zero["offload_param"] = {"device": offload_param}
    cfg["zero_optimization"] = zero
    return cfg


def test_the_delayed_update_counts_a_spare_gradient_partition():
    plain = estimate_memory("gpt2-xl", _config(), 1, accelerator=True)
    dpu = estimate_memory("gpt2-xl", _config(dpu=True), 1, accelerator=True)
    assert "grad_spare" not in plain.host
    # At one micro-step per step the host step writes the 16-bit parameters over the 16-bit gradient, with or
    # without the delayed update: no publish buffer and no staging ring. The gradient buffer is lent to the delayed
    # step (`BufferLease`): no spare partition either; its landing buffers are the partition again on the device.
    assert "param_staging" not in dpu.host and "param_staging" not in plain.host and "grad_spare" not in dpu.host
    assert dpu.host_bytes == plain.host_bytes
    assert dpu.device["param_incoming"] == plain.host["grad_partition"] == dpu.device_bytes - plain.device_bytes
    # Under accumulation the partition and its spare are fp32; the engine's breakdown counts both as grad_partition
    # and reports the staging pool on its own line.
    acc = estimate_memory("gpt2-xl", _config(gas=4, dpu=True), 1, accelerator=True)
    assert acc.host["grad_spare"] == acc.host["grad_partition"] == 2 * plain.host["grad_partition"]
    states = acc.model_states()
    assert states["grad_partition"] == acc.host["grad_partition"] + acc.host["grad_spare"]
    assert states["grad_staging"] == acc.host["grad_staging"] > 0 and "grad_spare" not in states
    # ... and the 16-bit partition its host step writes for publish (the gradient is fp32 there).
    assert acc.host["param_staging"] == plain.host["grad_partition"]


def _pool(pieces, nbytes=2) -> int:
    return sum(slots * size for slots, size in (staging_shape(p, nbytes) for p in pieces))


def test_gradient_staging_holds_two_whole_pieces_per_partition():
    """The engine's pool (`offload.grad_staging.staging_shape`): two pinned slots per accumulating offloaded
    partition, each the largest piece it receives in the reduced dtype (stage 2: its largest bucket, at most the
    partition; stage 3: its largest unit shard, in the communication dtype across ranks)."""
    for gas in (1, 2):
        assert ("grad_staging" in estimate_memory("gpt2", _config(gas=gas), 1, accelerator=True).host) == (gas > 1)
    shape = zero_offload.estimate.model_shape("gpt2")
    whole = [partition_numel(n, 1) for n in shape.group_numels()]
    small, large = (estimate_memory("gpt2", _config(gas=2, bucket=b), 1, accelerator=True) for b in (10**6, 10**9))
    assert small.host["grad_staging"] == _pool([min(10**6, p) for p in whole]) < large.host["grad_staging"]
    assert large.host["grad_staging"] == _pool(whole)                    # one bucket: the whole partition
    assert staging_shape(10**9, 2) == (STAGING_SLOTS, 2 * 10**9) and staging_shape(3, 2) == (STAGING_SLOTS, 64)
    # Stage 3: the largest unit shard per group partition, 16-bit, or fp32 when reduced in fp32.
    units = gpt_units(preset("gpt2"))
    shards = [max(padded_numel(sum(n), 2) // 2 for _, g, n in units if g == gi)
              for gi in sorted({g for _, g, _ in units})]
    est3 = estimate_memory("gpt2", _config(stage=3, gas=2, offload_param="cpu"), 2, accelerator=True)
    assert est3.host["grad_staging"] == _pool(shards)
    fp32 = dict(_config(stage=3, gas=2, offload_param="cpu"), communication_data_type="fp32")
    assert estimate_memory("gpt2", fp32, 2, accelerator=True).host["grad_staging"] == _pool(shards, 4)
    # Nothing on the host, or stage 1 (it overwrites at the boundary): no staging.
    assert "grad_staging" not in estimate_memory("gpt2", _config(gas=2, offload="none"), 1, accelerator=True).host
    assert not uses_grad_staging(1, True, 4) and not uses_grad_staging(2, False, 4) and uses_grad_staging(3, True, 2)
    with pytest.raises(ValueError, match="slots >= 1"):
        staging_shape(100, 2, slots=0)


def test_the_seeds_demo_plans_without_a_config():
    """The seed's 128 GB host holds 10B with bf16 moments only: they need the allowance (issue 59)."""
    assert not zero_offload.plan("gpt2-10b", **SEED).fits
    allowed = dict(SEED, allow_bf16_moments=True)
    p = zero_offload.plan("gpt2-10b", **allowed)
    assert p.fits and p.name == "stage 2 + offload opt, bf16 moments"
    b = p.batch
    assert b.checkpointing is True and b.micro > 1                # recompute buys a micro-batch that fills the GPU
    assert p.config["train_micro_batch_size_per_gpu"] == b.micro
    assert p.config["gradient_accumulation_steps"] == b.gas
    assert "activation_checkpointing" in p.reasons and p.reasons["activation_checkpointing"].startswith("on")
    assert "exposed" in p.reasons["step"]
    zero_offload.Config.load(p.config)
    # Exact by default: no delayed update unless allowed. Allowed, it fits the seed's 128 GB host: its step shares
    # the gradient buffer with the next backward (no spare partition: 10 host bytes/param with bf16 moments), its
    # landing buffers are on the device, and both sides stay inside the planner's 10 % headroom.
    assert not b.delayed and p.reasons["delayed_param_update"].startswith("off: exact by default")
    p = zero_offload.plan("gpt2-10b", allow_stale_step=True, **allowed)
    b = p.batch
    assert b.delayed and p.reasons["delayed_param_update"].startswith("on")
    assert b.gas == 1 and "grad_spare" not in b.estimate.host and b.estimate.device["param_incoming"] > 0
    assert b.estimate.host_bytes <= 0.9 * 128e9 and b.estimate.device_bytes <= 0.9 * 80e9
    # power: under accumulation the gradient is fp32 and a spare partition is needed: that does not fit
    accumulating = {**p.config, "gradient_accumulation_steps": 2}
    assert estimate_memory("gpt2-10b", accumulating, 1, micro_batch=b.micro, accelerator=True).host_bytes > 0.9 * 128e9
    roomy = zero_offload.plan("gpt2-10b", gpus=1, gpu_memory="80GB", host_memory="256GB", allow_stale_step=True)
    assert roomy.batch.delayed and roomy.batch.timing.exposed_share <= 0.10


def test_accumulation_hides_the_host_step():
    """gpt2-xl on a 24 GB GPU: micro-batch 1 without accumulation left the device idle ~98 % of the step."""
    p = zero_offload.plan("gpt2-xl", allow_stale_step=True, **XL)
    t = p.batch.timing
    # Stage 2 with offload (its smaller buckets leave room for the delayed update's landing buffers); stage 3 would
    # fit too, but its per-unit gathers cost time at one rank (`STAGE3_UNIT_SECONDS`)
    assert p.name.startswith("stage 2 + offload opt") and p.batch.delayed
    assert p.batch.micro * p.batch.gas * 1024 == t.tokens and t.tokens > 1024
    assert t.compute_s >= 0.9 * t.host_s and t.exposed_share <= 0.10
    # the delayed step's thread does a host step of work per step: the replayed step is at least that long
    assert t.exposed_s >= max(0.0, t.host_s - t.compute_s) - 1e-9 and abs(t.step_s - t.compute_s - t.exposed_s) < 1e-9
    # A faster host or a faster GPU never predicts fewer tokens/s; the faster GPU hides the host step behind more
    # micro-steps of accumulation.
    fast_host = zero_offload.plan("gpt2-xl", host_adam=2e10, allow_stale_step=True, **XL).batch.timing
    fast_gpu = zero_offload.plan("gpt2-xl", gpu_flops=1.6e15, allow_stale_step=True, **XL)
    assert fast_host.tokens_per_s >= t.tokens_per_s and fast_gpu.batch.timing.tokens_per_s > t.tokens_per_s
    assert fast_gpu.batch.gas > 1


def test_exposed_share_of_the_step_model():
    t = step_timing(micro_s=0.25, gas=2, host_s=1.0, delayed=True, tokens=4096)
    assert (t.compute_s, t.exposed_s, t.step_s) == (0.5, 0.5, 1.0) and t.exposed_share == 0.5
    t = step_timing(micro_s=0.25, gas=2, host_s=1.0, delayed=False, tokens=4096)
    assert t.exposed_s == 1.0 and t.step_s == 1.5 and abs(t.exposed_share - 2 / 3) < 1e-12
    assert accumulation_to_hide(0.25, 1.0, delayed=True) == 4          # 4 x 0.25 >= 0.9 x 1.0
    assert accumulation_to_hide(0.25, 1.0, delayed=False) == 36        # 1.0 <= 0.1 x (36 x 0.25 + 1.0)
    assert accumulation_to_hide(0.25, 0.0, delayed=True) == 1
    with pytest.raises(ValueError, match="gpu_flops must be a number > 0"):
        Assumptions(gpu_flops=0)


def test_given_settings_are_kept():
    p = zero_offload.plan("gpt2-xl", micro_batch=2, gradient_accumulation=3, activation_checkpointing=True, **XL)
    assert (p.batch.micro, p.batch.gas, p.batch.checkpointing) == (2, 3, True)
    assert "given micro-batch, given accumulation" in p.reasons["batch"]
    off = zero_offload.plan("gpt2-xl", activation_checkpointing=False, **XL)
    assert off.batch.checkpointing is False and "activation_checkpointing" not in off.reasons
    # A config's batch keys and its delayed-update choice are kept.
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_param_update": False}}}
    p = zero_offload.plan("gpt2-xl", config=cfg, **XL)
    assert (p.batch.micro, p.batch.gas, p.batch.delayed) == (4, 2, False)
    # Without an accelerator nothing but stage and offload is chosen: the config's batch, no step model.
    cpu = zero_offload.plan("tiny", gpus=1, gpu_memory=None, host_memory="24GiB")
    assert cpu.batch.timing is None and cpu.batch.micro == 1 and "batch" not in cpu.reasons


@pytest.mark.parametrize("kwargs,message", [
    (dict(gradient_accumulation=0), "gradient_accumulation must be an integer >= 1"),
    (dict(micro_batch=0), "micro_batch must be an integer >= 1"),
    (dict(host_adam=-1.0), "host_adam must be a number > 0"),
    (dict(pcie=0.0), "pcie must be a number > 0"),
])
def test_bad_batch_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zero_offload.plan("gpt2", **XL, **kwargs)


def _cli(capsys, *argv):
    rc = main(["estimate", "--no-deepspeed", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_plans_the_demo_and_says_what_is_exposed(capsys):
    rc, out, _ = _cli(capsys, "--model", "gpt2-10b", "--gpus", "1", "--gpu-mem", "80GB", "--host-mem", "128GB",
                      "--allow-bf16-moments")
    assert rc == 0 and "plan: stage 2 + offload opt, bf16 moments" in out
    assert "precision: bf16 moments: allowed (--allow-bf16-moments)" in out
    assert "activation_checkpointing: on" in out and "of the step exposed" in out and "grad_partition" not in out
    assert "delayed_param_update: off: exact by default" in out        # the flag below allows it
    rc, out, _ = _cli(capsys, "--model", "gpt2-xl", "--gpus", "1", "--gpu-mem", "24GB", "--host-mem", "64GB",
                      "--allow-stale-step")
    exposed = re.search(r"leave (\d+)% of the step exposed", out)
    assert rc == 0 and "gradient accumulation" in out and exposed and int(exposed.group(1)) <= 10
    assert "delayed_param_update: on" in out
    rc, out, _ = _cli(capsys, "--model", "gpt2-xl", "--gpu-mem", "24", "--host-mem", "64", "--micro-batch", "2",
                      "--grad-accum", "3", "--activation-checkpointing", "off", "--gpu-tflops", "200",
                      "--host-adam", "4e9", "--pcie", "50")
    assert rc == 0 and "micro-batch 2 x 1024 tokens, gradient accumulation 3" in out
    assert "at 200 TFLOP/s" in out and "host Adam 4.00 Gparam/s (x0.77 beside training)" in out and "at 50 GB/s" in out
    assert "at 3.08 Gparam/s beside training" in out            # the host step's rate: 4.00 x 0.77


@pytest.mark.parametrize("argv,message", [
    (["--grad-accum", "0"], "--grad-accum must be a whole number >= 1, got '0'"),
    (["--micro-batch", "two"], "--micro-batch must be a whole number >= 1, got 'two'"),
    (["--gpu-tflops", "0"], "--gpu-tflops must be a number > 0, got '0'"),
    (["--host-adam", "fast"], "--host-adam must be a number > 0, got 'fast'"),
    (["--pcie=-5"], "--pcie must be a number > 0, got '-5'"),
    (["--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
])
def test_cli_bad_batch_flags_name_the_flag(capsys, argv, message):
    rc, _, err = _cli(capsys, "--model", "gpt2", "--gpu-mem", "80GB", "--host-mem", "64GB", *argv)
    assert rc == 2 and message in err, err


def test_with_states_on_nvme_the_plan_keeps_a_share_on_the_device_or_speculates():
    """The seed's 10B model on an H200 with a 64 GB host: only the states on NVMe fit, and their I/O bounds the host
    step (every state read and written once at the built-in 2.5 GB/s). At accumulation 1 the plan keeps a share
    of each partition on the device (ratio < 1: less I/O); free to choose, it hides the step behind accumulation
    and super_offload's speculation into a second set of swap files."""
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/tmp", "pipeline_read": True, "pipeline_write": True}}}
    fixed = zero_offload.plan("gpt2-10b", gpu_memory="139GB", host_memory="64GB", nvme="2TB",
                              config=dict(config, train_micro_batch_size_per_gpu=16, gradient_accumulation_steps=1))
    assert fixed.name == "stage 2 + nvme opt" and fixed.batch.ratio < 1.0
    whole = zero_offload.plan("gpt2-10b", gpu_memory="139GB", host_memory="64GB", nvme="2TB", config=dict(
        config, train_micro_batch_size_per_gpu=16, gradient_accumulation_steps=1,
        zero_optimization={**config["zero_optimization"], "offload_optimizer": {
            **config["zero_optimization"]["offload_optimizer"], "ratio": 1.0}}))
    assert fixed.batch.timing.tokens_per_s > 1.2 * whole.batch.timing.tokens_per_s
    free = zero_offload.plan("gpt2-10b", gpu_memory="139GB", host_memory="64GB", nvme="2TB", config=config)
    assert free.batch.speculative and "swap files" in free.reasons["super_offload"]
    assert free.batch.timing.exposed_share <= 0.10
