"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed 0.16+'s API, for RL loops).

A run that offloads and reloads its states after every micro-step (so in the middle of gradient accumulation
too) ends bitwise where the same run without them ends, at stages 0-3, with the optimizer on the device and
offloaded, on 1 and 2 ranks; the run is within 1e-5 of AdamW. While offloaded, no device-side tensor of the
offloaded types keeps any bytes, and forward, backward and step raise. Bad arguments are refused by name.
"""
import pytest
import torch

import zero_offload
from dist_utils import run_ranks
from reference import MICRO, engine_config, reference_run
from toy_model import batch, make_model
from zero_offload.offload.state_offload import STATE_TYPES, state_type

STEPS, GAS = 3, 2


def _train(config: dict, offload_every_micro_step: bool, include=None):
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    ws = dist.get_world_size() if dist.is_initialized() else 1
    engine = zero_offload.initialize(make_model(), config)
    losses, held_while_offloaded = [], []
    for step in range(STEPS):
        x, y = batch(step, MICRO * GAS * ws)
        for k in range(GAS):
            rows = slice((rank * GAS + k) * MICRO, (rank * GAS + k + 1) * MICRO)
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if offload_every_micro_step:
                engine.offload_states(include=include)
                held_while_offloaded.append(_device_bytes(engine, include))
                engine.reload_states()
    state = engine.full_state_dict()
    engine.close()
    return state, losses, held_while_offloaded


def _device_bytes(engine, include) -> int:
    """Bytes still held by the device-side tensors of the offloaded types (0 once they are offloaded)."""
    types = set(STATE_TYPES if include is None else include)
    total = 0
    for kind, entry in engine.zero.memory_kinds().items():
        if isinstance(entry, tuple) and entry[0] == "device" and state_type(kind) in types:
            total += sum(t.untyped_storage().nbytes() for t in entry[1])
    return total


CASES = {"stage0": dict(stage=0), "stage1": dict(stage=1), "stage2": dict(stage=2),
         "stage2-offload": dict(stage=2, offload="cpu"), "stage3": dict(stage=3),
         "stage3-offload-all": dict(stage=3, offload="cpu", offload_param={"device": "cpu"})}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trips_mid_accumulation_are_bitwise(case):
    cfg = engine_config(gas=GAS, **CASES[case])
    plain, plain_losses, _ = _train(cfg, False)
    moved, losses, held = _train(cfg, True)
    assert losses == plain_losses
    for name in plain:
        assert torch.equal(plain[name], moved[name]), name
    assert held == [0] * len(held)
    ref, _ = reference_run(gas=GAS, steps=STEPS)
    assert max((ref[n] - moved[n]).abs().max().item() for n in ref) <= 1e-5


def test_offloaded_types_free_their_device_bytes_and_the_others_stay():
    engine = zero_offload.initialize(make_model(), engine_config(stage=2, gas=GAS))
    x, y = batch(0, MICRO)
    for _ in range(GAS):                    # one step: the moments exist
        engine.backward(engine(x, y))
        engine.step()
    engine.backward(engine(x, y))           # mid-accumulation: the gradient partitions hold the first micro-step
    before = _device_bytes(engine, ["optim_states"])
    assert before > 0 and _device_bytes(engine, ["lp_params"]) > 0
    engine.offload_states(include=["lp_grads", "hp_params"])
    assert _device_bytes(engine, ["lp_grads", "hp_params"]) == 0
    assert _device_bytes(engine, ["optim_states"]) == before      # not included: untouched
    engine.reload_states()
    engine.close()


def test_training_while_offloaded_raises_and_bad_arguments_are_named():
    engine = zero_offload.initialize(make_model(), engine_config(stage=3))
    x, y = batch(0, MICRO)
    with pytest.raises(ValueError, match="'gpu_states' is not a state type"):
        engine.offload_states(include=["gpu_states"])
    with pytest.raises(ValueError, match="NVMe is refused"):
        engine.offload_states(device="nvme")
    with pytest.warns(UserWarning, match="nothing offloaded"):
        engine.offload_states(device="none")
    engine.offload_states()
    for call in (lambda: engine(x, y), lambda: engine.step()):
        with pytest.raises(RuntimeError, match="states are offloaded .*call engine.reload_states"):
            call()
    engine.reload_states()
    engine.backward(engine(x, y))
    engine.step()
    engine.close()


def _two_rank_case(stage: int, offload: str):
    cfg = engine_config(stage=stage, offload=offload, gas=GAS, ws=2)
    plain, plain_losses, _ = _train(cfg, False)
    moved, losses, held = _train(cfg, True)
    return (losses == plain_losses and all(torch.equal(plain[n], moved[n]) for n in plain)
            and held == [0] * len(held))


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "none")])
def test_two_ranks_round_trips_are_bitwise(stage, offload):
    assert run_ranks(_two_rank_case, 2, stage, offload) == [True, True]


def test_the_drop_in_has_both():
    from zero_offload import deepspeed as ds
    engine, *_ = ds.initialize(model=make_model(), config=engine_config(stage=2))
    x, y = batch(0, MICRO)
    engine.offload_states()
    engine.reload_states()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    engine.destroy()
