"""Checkpoints of torch optimizers run on the partitions (SGD, Adagrad, RAdam, ...): saved on 2 ranks, loaded
on 1 (resharded), continued, and compared with one uninterrupted plain-torch run; what the format cannot hold
is refused naming the optimizer type and the state key."""
import pytest
import torch
import torch.distributed as dist

import zero_offload
from dist_utils import run_ranks
from toy_model import batch, make_model
from zero_offload.checkpoint import CheckpointError

MICRO, FIRST, THEN = 2, 3, 2

OPTIMIZERS = {
    "sgd": ({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1}},
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1)),
    "adagrad": ({"type": "Adagrad", "params": {"lr": 0.01, "initial_accumulator_value": 0.1}},
                lambda p: torch.optim.Adagrad(p, lr=0.01, initial_accumulator_value=0.1)),
    "radam": ({"type": "RAdam", "params": {"lr": 0.003}}, lambda p: torch.optim.RAdam(p, lr=0.003)),
}


def _config(optimizer, stage, offload, gas=1):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "optimizer": optimizer,
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload},
                                  "stage3_param_persistence_threshold": 100}}


def _train(engine, first, steps, ws, rank, gas):
    for step in range(first, first + steps):
        x, y = batch(step, MICRO * 2)                # the global batch of the 2-rank run
        for k in range(gas):
            rows = slice((rank * gas + k) * MICRO, (rank * gas + k + 1) * MICRO)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()


def _save(cfg, tmp):
    engine = zero_offload.initialize(make_model(), cfg)
    _train(engine, 0, FIRST, 2, dist.get_rank(), 1)
    engine.save_checkpoint(tmp)


def _reference(make_opt, steps):
    model = make_model()
    opt = make_opt(model.parameters())
    for step in range(steps):
        x, y = batch(step, MICRO * 2)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name,stage,offload", [("sgd", 2, "none"), ("adagrad", 2, "cpu"), ("radam", 3, "cpu"),
                                                ("sgd", 3, "none")])
def test_save_on_two_ranks_resume_on_one_matches_torch(name, stage, offload, tmp_path):
    optimizer, make_opt = OPTIMIZERS[name]
    run_ranks(_save, 2, _config(optimizer, stage, offload), tmp_path)
    torch.manual_seed(5)                             # another init: everything must come from the checkpoint
    engine = zero_offload.initialize(make_model(), _config(optimizer, stage, offload, gas=2))
    engine.load_checkpoint(tmp_path)
    assert engine.global_step == FIRST
    _train(engine, FIRST, THEN, 1, 0, 2)
    ref = _reference(make_opt, FIRST + THEN)
    full = engine.full_state_dict()
    for n, r in ref.items():
        assert (full[n] - r).abs().max().item() <= 1e-5, n


@pytest.mark.parametrize("optimizer,key", [
    ({"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True}}, "max_exp_avg_sq"),
    ({"type": "NAdam", "params": {"lr": 1e-3}}, "mu_product"),
])
def test_states_the_format_cannot_hold_are_refused_naming_type_and_key(optimizer, key, tmp_path):
    engine = zero_offload.initialize(make_model(), _config(optimizer, 2, "none"))
    _train(engine, 0, 1, 1, 0, 1)
    with pytest.raises(NotImplementedError, match=f"{optimizer['type']}.*'{key}'"):
        engine.save_checkpoint(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]      # nothing half-written is left


def test_a_checkpoint_loads_only_into_the_same_optimizer_form(tmp_path):
    sgd = zero_offload.initialize(make_model(), _config(OPTIMIZERS["sgd"][0], 2, "none"))
    _train(sgd, 0, 1, 1, 0, 1)
    sgd.save_checkpoint(tmp_path)
    adam = zero_offload.initialize(make_model(), _config({"type": "Adam", "params": {"lr": 1e-3}}, 2, "none"))
    before = adam.full_state_dict()
    with pytest.raises(CheckpointError, match="torch.SGD:momentum_buffer.*'adam'"):
        adam.load_checkpoint(tmp_path)
    assert all(torch.equal(before[n], t) for n, t in adam.full_state_dict().items())
