"""`import zero_offload.deepspeed as deepspeed`: DeepSpeed's initialize tuple, engine face, client optimizer
and scheduler, dataloader, zero.Init / GatheredParameters, save_16bit_model; numbers against torch."""
import argparse
import warnings

import pytest
import torch
import torch.distributed as dist

import zero_offload
import zero_offload.deepspeed as deepspeed
from dist_utils import run_ranks
from reference import LR, MICRO, WD
from toy_model import ToyTransformer, batch, make_model

CFG = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 2}}
ADAM = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}   # without a client optimizer a config needs one


def _train(engine, steps=3, ws=1, rank=0):
    for step in range(steps):
        x, y = batch(step, MICRO * ws)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()


def _torch_run(make_opt, steps=3, sched=None):
    model = make_model()
    opt = make_opt(model.parameters())
    s = sched(opt) if sched else None
    lrs = []
    for step in range(steps):
        x, y = batch(step, MICRO)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        if s:
            s.step()
        lrs.append(opt.param_groups[0]["lr"])
    return dict(model.named_parameters()), lrs


def _close(engine, ref, atol=1e-5):
    full = engine.full_state_dict()
    for name, p in ref.items():
        assert (full[name] - p.detach()).abs().max().item() <= atol, name


def test_initialize_returns_deepspeeds_tuple_and_an_nn_module():
    model = make_model()
    engine, optimizer, loader, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                            config={**CFG, "optimizer": {"type": "AdamW"}})
    assert isinstance(engine, torch.nn.Module) and engine.module is model and loader is None and sched is None
    assert optimizer is engine.optimizer and optimizer.param_groups[0]["lr"] == 1e-3
    names = [n for n, _ in engine.named_parameters()]
    assert names[0] == "module.wte.weight" and len(list(engine.parameters())) == len(list(model.parameters()))
    assert model in list(engine.modules()) and "module.ln_f.weight" in engine.state_dict()
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training and engine.train_batch_size() == MICRO and engine.gradient_accumulation_steps() == 1
    assert engine.device == torch.device("cpu") and engine.local_rank == 0 and engine.zero_optimization_stage() == 2


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD),
    lambda p: torch.optim.Adam(p, lr=LR, weight_decay=WD, betas=(0.8, 0.99)),    # L2 decay: adam_w_mode off
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
])
def test_client_optimizer_matches_torch(make_opt):
    model = make_model()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=make_opt(model.parameters()),
                                                   config={**CFG, "optimizer": {"type": "Lamb"}})  # replaced
    _train(engine)
    _close(engine, _torch_run(make_opt)[0])


def test_client_optimizer_callable_and_scheduler():
    model = make_model()
    engine, optimizer, _, sched = deepspeed.initialize(
        model=model, optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=WD),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), config=CFG)
    _train(engine)
    ref, lrs = _torch_run(lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD),
                          sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    _close(engine, ref)
    assert engine.get_lr() == pytest.approx([lrs[-1]])


def test_client_scheduler_object_over_the_client_optimizer():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    engine, _, _, ds_sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=CFG)
    _train(engine)
    ref, lrs = _torch_run(lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD),
                          sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)))
    _close(engine, ref)
    assert ds_sched.get_last_lr() == pytest.approx([lrs[-1]]) and engine.get_lr() == pytest.approx([lrs[-1]])


def test_not_a_torch_optimizer_is_refused():
    class Mine(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})
    model = make_model()
    with pytest.raises(ValueError, match="Mine is not a torch.optim optimizer"):
        deepspeed.initialize(model=model, optimizer=Mine(model.parameters()), config=CFG)


def test_config_from_args_and_errors(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, // hjson\n "zero_optimization": {"stage": 1},\n'
                    ' "optimizer": {"type": "Adam"},}')
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, *_ = deepspeed.initialize(args=args, model=make_model())
    assert engine.zero_optimization_stage() == 1
    with pytest.raises(zero_offload.ConfigError, match="both as args.deepspeed_config"):
        deepspeed.initialize(args=args, model=make_model(), config=CFG)
    with pytest.raises(zero_offload.ConfigError, match="needs a config"):
        deepspeed.initialize(model=make_model())
    with pytest.raises(ValueError, match="requires a model"):
        deepspeed.initialize(config=CFG)
    engine, *_ = deepspeed.initialize(model=make_model(), config_params={**CFG, **ADAM})   # the old name
    assert engine.zero_optimization_stage() == 2


def _loader_run():
    data = torch.utils.data.TensorDataset(torch.arange(10))
    engine, _, loader, _ = deepspeed.initialize(model=make_model(), training_data=data,
                                                config={**CFG, **ADAM, "dataloader_drop_last": True})
    return [b[0].tolist() for b in loader]


def test_dataloader_uses_a_distributed_sampler():
    r0, r1 = run_ranks(_loader_run, 2)
    sampler = torch.utils.data.DistributedSampler(range(10), num_replicas=2, rank=0)
    assert [x for b in r0 for x in b] == list(sampler)[:4] and all(len(b) == MICRO for b in r0 + r1)
    assert not set(x for b in r0 for x in b) & set(x for b in r1 for x in b)


def test_boundary_grad_norm_and_skipped_steps():
    engine, *_ = deepspeed.initialize(model=make_model(), config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "fp16": {"enabled": True},
        "zero_optimization": {"stage": 1}, **ADAM})
    x, y = batch(0, MICRO)
    assert not engine.is_gradient_accumulation_boundary()
    engine.backward(engine(x, y))
    engine.step()
    assert engine.is_gradient_accumulation_boundary()        # the coming micro-step ends the accumulation
    engine.backward(engine(x, y) * float("inf"))
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    engine.set_gradient_accumulation_boundary(True)          # a one-micro-step accumulation
    engine.backward(engine(x, y))
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 2 and engine.get_global_grad_norm() > 0
    engine.zero_grad()


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "none")])
def test_forced_boundary_on_a_first_micro_step_steps_that_micro_batch_alone(stage, offload):
    """set_gradient_accumulation_boundary(True) right after a step: a one-micro-step accumulation whose gradient
    is that micro-batch's alone (divided by gradient_accumulation_steps, as DeepSpeed's backward does), not added
    onto the previous accumulation's partition."""
    engine, *_ = deepspeed.initialize(model=make_model(), config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload}}})
    ref = make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    x, y = batch(0, 3 * MICRO)
    rows = [slice(k * MICRO, (k + 1) * MICRO) for k in range(3)]
    for accumulation in ([rows[0], rows[1]], [rows[2]]):
        for k, r in enumerate(accumulation):
            if len(accumulation) == 1:
                engine.set_gradient_accumulation_boundary(True)
            engine.backward(engine(x[r], y[r]))
            engine.step()
            (ref(x[r], y[r]) / 2).backward()
        opt.step()
        opt.zero_grad()
    assert engine.global_steps == 2
    with zero_offload.gathered_parameters(engine.module.parameters()):
        for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5, msg=name)


def test_save_16bit_model_and_load_checkpoint(tmp_path):
    cfg = {**CFG, **ADAM, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    _train(engine, 1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert engine.save_16bit_model(tmp_path) is False
    assert "stage3_gather_16bit_weights_on_model_save" in str(w[-1].message)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    _train(engine, 1)
    assert engine.save_16bit_model(tmp_path, "model.pt")
    sd = torch.load(tmp_path / "model.pt")
    assert sd["wte.weight"].dtype == torch.bfloat16 and sd["head.weight"].shape == (48, 32)
    fresh = make_model().to(torch.bfloat16)
    fresh.load_state_dict(sd, strict=True)
    full = engine.full_state_dict()
    assert torch.equal(fresh.wte.weight.float(), full["wte.weight"].bfloat16().float())
    engine.save_checkpoint(tmp_path / "ck", client_state={"epoch": 3})
    path, client = engine.load_checkpoint(tmp_path / "ck")
    assert client == {"epoch": 3} and path.endswith("global_step1")


# -- stage 3: zero.Init, GatheredParameters, parameters used outside their module ------------------------
def _init_and_modify():
    rank = dist.get_rank()
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        model = ToyTransformer()
        with deepspeed.zero.GatheredParameters(model.wpe.weight, modifier_rank=0):   # a post_init
            if rank == 0:
                model.wpe.weight.data.fill_(0.5)
    assert all(p.is_meta for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config={**CFG, "optimizer": {
        "type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, "zero_optimization": {"stage": 3}})
    built = engine.full_state_dict()
    with deepspeed.zero.GatheredParameters(list(model.ln_f.parameters()), modifier_rank=0):
        if rank == 0:
            model.ln_f.weight.data.fill_(2.0)
    with deepspeed.zero.GatheredParameters([model.ln_f.bias]):     # no modifier: discarded
        model.ln_f.bias.data.fill_(7.0)
    modified = engine.full_state_dict()
    _train(engine, 2, ws=2, rank=rank)
    return built, modified, engine.full_state_dict()


def test_zero_init_keeps_constructor_values_and_gathered_writes_back():
    results = run_ranks(_init_and_modify, 2)
    torch.manual_seed(0)
    ref = ToyTransformer()
    with torch.no_grad():
        ref.wpe.weight.fill_(0.5)
    for built, modified, _ in results:
        for name, p in ref.named_parameters():
            assert torch.equal(built[name], p.detach()), name            # bit-identical to a normal build
        assert (modified["ln_f.weight"] == 2.0).all() and torch.equal(modified["ln_f.bias"], ref.ln_f.bias)
    with torch.no_grad():
        ref.ln_f.weight.fill_(2.0)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for step in range(2):
        x, y = batch(step, MICRO * 2)
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
    for *_, trained in results:        # the written values were trained on (masters included)
        for name, p in ref.named_parameters():
            assert (trained[name] - p.detach()).abs().max().item() <= 1e-5, name


def _custom_loss_run(register):
    rank = dist.get_rank()
    model = make_model()
    if register:
        deepspeed.zero.register_external_parameter(model.ln_f, model.wpe.weight)
    engine, *_ = deepspeed.initialize(model=model, config={**CFG, "optimizer": {
        "type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0}})
    regathered = 0
    for step in range(2):
        x, y = batch(step, MICRO * 2)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = engine(x[rows], y[rows])
        with zero_offload.gathered_parameters([model.wte.weight]):     # read outside its module
            extra = model.wte.weight.pow(2).mean()                    # released before backward
        engine.backward(loss + extra)
        engine.step()
        regathered += engine.stats.regathers
    return engine.full_state_dict(), regathered


@pytest.mark.parametrize("register", [False, True])
def test_parameter_used_outside_its_module_is_gathered_for_backward(register):
    results = run_ranks(_custom_loss_run, 2, register)
    ref = make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for step in range(2):
        x, y = batch(step, MICRO * 2)
        opt.zero_grad()
        (ref(x, y) + ref.wte.weight.pow(2).mean()).backward()
        opt.step()
    for full, regathered in results:
        assert regathered > 0
        for name, p in ref.named_parameters():
            assert (full[name] - p.detach()).abs().max().item() <= 1e-5, name
