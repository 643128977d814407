"""``offload_optimizer.gradients_on_device``: the reduced gradient partition stays on the device and the host step
pulls it down chunk by chunk (`zero_offload.hoststep.grad_stream`).

- fp32 at stages 1, 2 and 3, accumulation 1 and 3, clipping off and on, 1 and 2 ranks: within 1e-5 of
  ``torch.optim.AdamW`` on one process, and without clipping bitwise the run that keeps the partition in host memory
  (with clipping the global norm sums its squares in another grouping: last bits). Chunks of 700 elements, so a
  step walks several and reuses the stream's slots (bf16 and fp16 in `test_exact16`, stream ordering in
  `test_simulated_streams`);
- two param groups of different sizes share one stream, bf16 with one micro-step (parameters written over the
  gradient's slot) and under accumulation (rounded through the ring): bitwise the host partition's run;
- the partition is counted on the device, host memory holds only the stream's slots in its place (with bf16 masters
  and moments 6 bytes per parameter and the slots, against 8), and the memory model predicts every kind to the byte;
- a step whose kernel fails midway leaves no copy up pending for a later step;
- what it does not combine with is refused, naming the keys (an optimizer the fused kernel does not run when the
  config loads).
"""
from __future__ import annotations

import pytest
import torch

import zero_offload
from reference import (assert_estimated, assert_matches_adamw, engine_config, paired_runs, reference_run,
                       train_step)
from toy_model import make_model
from zero_offload.config import ConfigError

ATOL = 1e-5
CHUNK = 700
CASES = [(1, 3, 1.0), (2, 1, 0.0), (2, 3, 1.0), (3, 1, 1.0), (3, 3, 0.0)]      # stage, accumulation, clipping


def on_device_config(stage: int, gas: int, clip: float, on_device: bool = True) -> dict:
    cfg = engine_config(stage, "cpu", gas, clip)
    cfg["zero_optimization"]["offload_optimizer"].update(gradients_on_device=on_device, copy_chunk=CHUNK)
    return cfg


@pytest.fixture(scope="module")
def results():
    return paired_runs(CASES, lambda case: [on_device_config(*case), on_device_config(*case, on_device=False)])


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("stage,gas,clip", CASES)
def test_matches_adamw_and_the_host_partition(results, ws, stage, gas, clip):
    ref, ref_losses = reference_run(gas=gas, clip=clip, ws=ws)
    run, on_host = results[(ws, stage, gas, clip)]
    assert_matches_adamw(run, ref, ref_losses, ATOL, bitwise=on_host[0] if clip == 0.0 else None)
    if clip == 0.0:
        assert run[2] == on_host[2]


def breakdown_after_a_step(config: dict) -> dict:
    """``memory_breakdown()`` of the toy model's engine after one whole step (the stream's slots are made at the
    first)."""
    engine = zero_offload.initialize(make_model(), config)
    train_step(engine, 0, 0, 1)
    held = engine.memory_breakdown()
    engine.close()
    return held


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_the_partition_is_on_the_device_and_predicted(stage):
    on_device = breakdown_after_a_step(on_device_config(stage, 3, 0.0))
    on_host = breakdown_after_a_step(on_device_config(stage, 3, 0.0, on_device=False))
    partition = on_host["grad_partition"]["bytes"]
    assert on_host["grad_partition"]["side"] == "host" and partition > 0
    if stage == 1:       # a view of the full gradient the device holds anyway
        assert on_device["grad_partition"]["bytes"] == 0
    else:                # fp32 under accumulation, as on the host
        assert on_device["grad_partition"] == {**on_host["grad_partition"], "side": "device"}
    host = {side: sum(v["bytes"] for v in held.values() if v["side"] == "host")
            for side, held in (("device", on_device), ("host", on_host))}
    staging = on_host.get("grad_staging", {"bytes": 0})["bytes"]
    slots = 3 * CHUNK * 4            # fp32 training: fp32 gradients
    assert host["device"] == host["host"] - partition - staging + slots
    assert_estimated(on_device, on_device_config(stage, 3, 0.0))


@pytest.mark.parametrize("change,keys", [
    ({"offload_optimizer": {"device": "none", "gradients_on_device": True}}, ("gradients_on_device", "device")),
    ({"offload_optimizer": {"device": "cpu", "gradients_on_device": True, "delayed_param_update": True}},
     ("gradients_on_device", "delayed_param_update")),
    ({"offload_optimizer": {"device": "cpu", "gradients_on_device": True, "super_offload": True}},
     ("gradients_on_device", "super_offload")),
    ({"offload_optimizer": {"device": "cpu", "gradients_on_device": True, "ratio": 0.5}},
     ("gradients_on_device", "ratio")),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "gradients_on_device": True}},
     ("gradients_on_device", "'nvme'")),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "gradients_on_device": True},
      "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, ("gradients_on_device", "offload_param.device")),
])
def test_what_does_not_combine_is_refused(change, keys):
    cfg = engine_config(2, "cpu")
    cfg["zero_optimization"].update(change)
    with pytest.raises(ConfigError) as err:
        zero_offload.initialize(make_model(), cfg)
    for key in keys:
        assert key in str(err.value)


@pytest.mark.parametrize("optimizer,name", [({"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True}}, "amsgrad"),
                                            ({"type": "SGD", "params": {"lr": 1e-3}}, "SGD"),
                                            ({"type": "Lamb", "params": {"lr": 1e-3}}, "Lamb"),
                                            ({"type": "Muon", "params": {"lr": 1e-3}}, "Muon")])
def test_an_optimizer_without_the_chunked_kernel_is_refused_when_the_config_loads(optimizer, name):
    """Refused by the config itself, so the planner never offers it."""
    cfg = on_device_config(2, 1, 0.0)
    cfg["optimizer"] = optimizer
    with pytest.raises(ConfigError) as err:
        zero_offload.Config.load(cfg)
    assert "gradients_on_device" in str(err.value) and name in str(err.value)


def two_group_run(config: dict) -> tuple[dict, list[float]]:
    """bf16 training of the toy model with two param groups of different sizes (matrices with weight decay, the rest
    without): its masters and losses after `STEPS` steps."""
    from reference import STEPS
    model = make_model().to(torch.bfloat16)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    engine = zero_offload.initialize(model, config, model_parameters=[{"params": matrices},
                                                                      {"params": rest, "weight_decay": 0.0}])
    losses = [train_step(engine, step, 0, 1) for step in range(STEPS)]
    masters = engine.full_state_dict()
    engine.close()
    return masters, losses


@pytest.mark.parametrize("stage,gas", [(2, 1), (2, 3), (3, 1)])
def test_several_groups_share_one_stream(stage, gas):
    """Two groups through one stream, bf16: the parameters written over the gradient's slot (one micro-step) or
    rounded through the ring (fp32 accumulation), bitwise the run with the partitions on the host."""
    configs = [on_device_config(stage, gas, 0.0, on_device=flag) | {"bf16": {"enabled": True}}
               for flag in (True, False)]
    (on_device, device_losses), (on_host, host_losses) = (two_group_run(c) for c in configs)
    assert device_losses == host_losses
    for name, value in on_host.items():
        assert torch.equal(on_device[name], value), name


def test_a_step_that_fails_midway_leaves_no_copy_behind(monkeypatch):
    """The kernel fails at its third chunk, with copies up in flight on the issuing thread (simulated streams): the
    step raises, every copy up it started is queued and the compute stream waits for them before it returns (none
    is left pending for a later step to meet), and the engine closes without hanging."""
    from zero_offload.hoststep.grad_stream import GradStream
    from zero_offload.offload import simulated
    fetch, calls = GradStream.fetch, []

    def failing(self, g, param, lo, hi):
        calls.append(lo)
        if len(calls) == 3:
            raise RuntimeError("kernel failed")
        return fetch(self, g, param, lo, hi)
    cfg = on_device_config(2, 1, 0.0) | {"bf16": {"enabled": True}}
    with simulated.forced():
        engine = zero_offload.initialize(make_model().to(torch.bfloat16), cfg)
        monkeypatch.setattr(GradStream, "fetch", failing)
        with pytest.raises(RuntimeError, match="kernel failed"):
            train_step(engine, 0, 0, 1)
        monkeypatch.setattr(GradStream, "fetch", fetch)
        assert engine.optimizer_state.adam.up.pending == []      # `CopiesUp.pending`: released
        engine.close()


def test_bf16_masters_and_moments_leave_six_host_bytes_per_parameter():
    """bf16 masters and moments with the partition on the device: the host holds 2 + 2 + 2 bytes per parameter of
    this rank's partition and the stream's three chunks, nothing more (8 with the partition on the host)."""
    bf16 = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    held = {flag: breakdown_after_a_step(on_device_config(2, 1, 0.0, on_device=flag) | bf16) for flag in (True, False)}
    n = held[True]["master"]["numel"]
    host = {flag: sum(v["bytes"] for v in h.values() if v["side"] == "host") for flag, h in held.items()}
    assert host[True] == 6 * n + 3 * CHUNK * 2 and host[False] == 8 * n
