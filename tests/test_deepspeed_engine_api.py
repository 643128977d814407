"""DeepSpeed 0.19.8 engine calls beyond the step loop: zero_grad (what it discards at each stage),
backward(retain_graph=True), initialize(mpu=...), zero.Init(module=...); each against plain torch."""
import pytest
import torch
import torch.distributed as dist

import zero_offload.deepspeed as deepspeed
from dist_utils import run_ranks
from reference import LR, MICRO, WD
from toy_model import ToyTransformer, batch, make_model

ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
ATOL = 1e-5


def _config(stage, gas=1):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, **ADAMW,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100}}


def _close(engine, ref):
    full = engine.full_state_dict()
    for name, p in ref.items():
        assert (full[name] - p.detach()).abs().max().item() <= ATOL, name


def _torch_steps(micro_batches_per_step, scale, extra_loss=False):
    """AdamW over ``micro_batches_per_step`` lists of (step, row) micro-batches, each loss x ``scale``."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for micro in micro_batches_per_step:
        opt.zero_grad()
        for step, row in micro:
            x, y = batch(step, MICRO * 2)
            loss = model(x[row * MICRO:(row + 1) * MICRO], y[row * MICRO:(row + 1) * MICRO])
            ((loss + 0.5 * loss) * scale if extra_loss else loss * scale).backward()
        opt.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_discards_what_deepspeed_discards(stage):
    """gas 2: micro-batch 0, zero_grad(), micro-batch 1, step. DeepSpeed's engine.zero_grad() clears
    param.grad, which holds the accumulation at stages 0/1 (dropped) but not at stages 2/3 (kept)."""
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(stage, gas=2))
    for step in range(2):
        x, y = batch(step, MICRO * 2)
        engine.backward(engine(x[:MICRO], y[:MICRO]))
        engine.step()
        engine.zero_grad()
        engine.backward(engine(x[MICRO:], y[MICRO:]))
        engine.step()
        engine.zero_grad()                    # after the step: nothing left to drop at any stage
    kept = [[(s, 0), (s, 1)] for s in range(2)]
    dropped = [[(s, 1)] for s in range(2)]
    _close(engine, _torch_steps(dropped if stage < 2 else kept, 0.5))
    assert engine.engine.discard_accumulated_gradients() is (stage < 2)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_backward_with_retain_graph_adds_a_second_backward_through_the_same_graph(stage):
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(stage))
    for step in range(2):
        x, y = batch(step, MICRO * 2)
        loss = engine(x[:MICRO], y[:MICRO])
        engine.backward(loss, retain_graph=True)
        engine.backward(0.5 * loss)           # the graph (and at stage 3 its saved parameters) is still there
        engine.step()
    _close(engine, _torch_steps([[(s, 0)] for s in range(2)], 1.0, extra_loss=True))


class _Mpu:
    def __init__(self, mp=1, dp_group=None, dp_size=None):
        self.mp, self.dp_group, self.dp_size = mp, dp_group, dp_size

    def get_model_parallel_world_size(self):
        return self.mp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self):
        return self.dp_size if self.dp_size is not None else dist.get_world_size()


def _mpu_run():
    world = dist.group.WORLD
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(2), mpu=_Mpu(dp_group=world))
    rank = dist.get_rank()
    for step in range(2):
        x, y = batch(step, MICRO * 2)
        engine.backward(engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
        engine.step()
    errors = []
    for bad in (_Mpu(mp=2, dp_group=world), _Mpu(dp_group=dist.new_group([0])), _Mpu(dp_size=1)):
        try:
            deepspeed.initialize(model=make_model(), config=_config(2), mpu=bad)
        except ValueError as e:
            errors.append(str(e))
    return engine.full_state_dict(), errors


def test_mpu_of_plain_data_parallelism_is_accepted_and_others_refused_naming_mpu():
    state, errors = run_ranks(_mpu_run, 2)[0]
    ref = _torch_steps([[(s, 0), (s, 1)] for s in range(2)], 0.5)
    for name, p in ref.items():
        assert (state[name] - p.detach()).abs().max().item() <= ATOL, name
    assert len(errors) == 3
    assert "mpu.get_model_parallel_world_size() = 2" in errors[0]
    assert "mpu.get_data_parallel_group() holds ranks [0]" in errors[1]
    assert "mpu.get_data_parallel_world_size() = 1" in errors[2]


def _init_module_run():
    torch.manual_seed(dist.get_rank())        # ranks build different values: rank 0's must win, as in DeepSpeed
    model = ToyTransformer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    deepspeed.zero.Init(module=model)
    assert all(p.is_meta for p in model.parameters())       # the full values are freed at once
    engine, *_ = deepspeed.initialize(model=model, config=_config(3))
    rank = dist.get_rank()
    built = engine.full_state_dict()
    for step in range(2):
        x, y = batch(step, MICRO * 2)
        engine.backward(engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
        engine.step()
    return before, built, engine.full_state_dict()


def test_zero_init_module_partitions_an_existing_model_in_place():
    results = run_ranks(_init_module_run, 2)
    rank0_values = results[0][0]
    torch.manual_seed(0)
    ref = ToyTransformer()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for step in range(2):
        x, y = batch(step, MICRO * 2)
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
    for _, built, trained in results:
        for name, v in rank0_values.items():
            assert torch.equal(built[name], v), name
        for name, p in ref.named_parameters():
            assert (trained[name] - p.detach()).abs().max().item() <= ATOL, name
