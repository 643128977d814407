"""The DeepSpeed face's modules (issue 57), in process: the live stage-3 attributes, one parameter's fp32 weights and
Adam moments against plain ``torch.optim.AdamW``, leaf modules, the frozen engine, the optimizer face, ``comm``,
``checkpointing``, ``zero_to_fp32`` on our checkpoints and DeepSpeed's, and each error the face raises.
"""
import math

import pytest
import torch

import zero_offload.deepspeed as deepspeed
from dist_utils import run_ranks
from zero_offload.compat.unbuilt import NotBuiltError
from zero_offload.config import ConfigError
from zero_offload.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

LR, WD, STEPS = 1e-2, 0.01, 3


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"},
                                  "stage3_param_persistence_threshold": 0, **zero}}


def _batches(world: int = 1):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4 * world, 8, generator=g) for _ in range(STEPS)]


def _reference():
    """Plain torch.optim.AdamW on one process: (model, optimizer) after STEPS steps of the whole batches."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for x in _batches(2):
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return model, opt


def _train_and_read(stage: int, leaf: bool = False):
    """On each of 2 ranks: train STEPS steps through the face; record ds_status at module pre-forward, forward and
    after the step, and read every parameter's full fp32 weight and moments with safe_get_full_*."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = _model()
    if leaf:
        deepspeed.utils.set_z3_leaf_modules(model, [torch.nn.Sequential])
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=_config(stage))
    seen = []
    first = engine.module[0]
    def record(where, m):
        seen.append((where, getattr(m.weight, "ds_status", None), m.weight.data.numel()))
    first.register_forward_pre_hook(lambda m, a: record("pre", m))
    first.register_forward_hook(lambda m, a, o: record("post", m))
    first.weight.register_hook(lambda g: record("grad", first))
    for x in _batches(world):
        engine.backward(engine(x[rank * 4:(rank + 1) * 4]).pow(2).mean())
        engine.step()
        record("after", first)
    p = first.weight
    facts = {"ds_shape": tuple(p.ds_shape), "ds_numel": p.ds_numel, "ds_tensor": p.ds_tensor.numel(),
             "ds_id": p.ds_id, "persist": p.ds_persist, "units": len(engine.engine.zero.units)} \
        if stage == 3 else {"has_ds_id": hasattr(p, "ds_id")}
    names = [n for n, _ in engine.module.named_parameters()]
    full = {n: deepspeed.utils.safe_get_full_fp32_param(q).cpu() for n, q in engine.module.named_parameters()}
    moments = {n: (deepspeed.utils.safe_get_full_optimizer_state(q, "exp_avg").cpu(),
                   deepspeed.utils.safe_get_full_optimizer_state(q, "exp_avg_sq").cpu())
               for n, q in engine.module.named_parameters()}
    local = {n: deepspeed.utils.safe_get_local_fp32_param(q).numel() for n, q in engine.module.named_parameters()}
    engine.close()
    return {"seen": [(w, s and s.name, n) for w, s, n in seen], "facts": facts, "names": names, "full": full,
            "moments": moments, "local": local, "overflow": optimizer.overflow, "scale": optimizer.cur_scale}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_fp32_weights_and_moments_match_torch_adamw_on_two_ranks(stage):
    """``safe_get_full_fp32_param``/``safe_get_full_optimizer_state`` assemble each parameter from both ranks'
    partitions and equal torch.optim.AdamW's weights and moments; the local pieces add up to the whole."""
    ranks = run_ranks(_train_and_read, 2, stage)
    ref, opt = _reference()
    for got in ranks:
        for name, p in ref.named_parameters():
            assert torch.allclose(got["full"][name], p.detach(), atol=1e-6), name
            assert torch.allclose(got["moments"][name][0], opt.state[p]["exp_avg"], atol=1e-7), name
            assert torch.allclose(got["moments"][name][1], opt.state[p]["exp_avg_sq"], atol=1e-9), name
    for name, p in ref.named_parameters():
        assert sum(r["local"][name] for r in ranks) == p.numel(), name
    assert all(r["overflow"] is False and r["scale"] == 1.0 for r in ranks)


def test_stage3_attributes_are_true_at_every_point_of_a_step():
    """Read in the module's pre-forward hook, in a forward hook registered after ``initialize`` (after the engine's
    own release, as under DeepSpeed), in the gradient hook during backward, and after the step: ``ds_status`` is
    AVAILABLE exactly when ``.data`` holds the whole parameter."""
    ranks = run_ranks(_train_and_read, 2, 3)
    for got in ranks:
        assert {w for w, _, _ in got["seen"]} == {"pre", "post", "grad", "after"}
        assert all((status == "AVAILABLE") == (numel == 128) for _, status, numel in got["seen"]), got["seen"]
        assert [s for w, s, _ in got["seen"] if w in ("pre", "after")] == ["AVAILABLE", "NOT_AVAILABLE"] * STEPS
        assert got["facts"]["ds_shape"] == (16, 8) and got["facts"]["ds_numel"] == 128
        assert got["facts"]["persist"] is False and got["facts"]["units"] == 2
    assert sum(r["facts"]["ds_tensor"] for r in ranks) == 128            # each rank its piece
    assert ranks[0]["facts"]["ds_id"] == ranks[1]["facts"]["ds_id"]       # the same id on every rank


def test_below_stage3_parameters_have_no_stage3_attributes():
    assert run_ranks(_train_and_read, 2, 2)[0]["facts"] == {"has_ds_id": False}
    assert not hasattr(torch.nn.Linear(2, 2).weight, "ds_numel")


def test_leaf_module_trains_as_torch_adamw():
    """``set_z3_leaf_modules``: the whole Sequential is one unit gathered at its forward (its Linears get no units
    and no hooks of their own), and training is unchanged."""
    ranks = run_ranks(_train_and_read, 2, 3, True)
    ref, _ = _reference()
    for got in ranks:
        assert got["facts"]["units"] == 1                   # one unit for the whole leaf (2 Linears without)
        for name, p in ref.named_parameters():
            assert torch.allclose(got["full"][name], p.detach(), atol=1e-6), name


def test_leaf_modules_not_found_is_an_error_naming_them():
    with pytest.raises(ValueError, match="No modules of type"):
        deepspeed.utils.set_z3_leaf_modules(_model(), [torch.nn.Conv2d])
    assert deepspeed.utils.set_z3_leaf_modules(_model(), [torch.nn.Conv2d], raise_if_not_found=False) == []
    with pytest.raises(ValueError, match="types or names"):
        deepspeed.utils.set_z3_leaf_modules(_model(), [3])


def test_safe_set_full_fp32_param_then_training_continues_as_torch_adamw():
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(2))
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    new = torch.full((4, 16), 0.5)
    deepspeed.utils.safe_set_full_fp32_param(engine.module[2].weight, new)
    with torch.no_grad():
        ref[2].weight.copy_(new)
    assert torch.equal(engine.module[2].weight.detach(), new)        # the 16-bit (here fp32) parameter follows
    for x in _batches(1):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        ref(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for name, p in ref.named_parameters():
        assert torch.allclose(deepspeed.utils.safe_get_full_fp32_param(dict(engine.module.named_parameters())[name]),
                              p.detach(), atol=1e-6), name
    with pytest.raises(ValueError, match="value has 3 elements, parameter 2.weight 64"):
        deepspeed.utils.safe_set_full_fp32_param(engine.module[2].weight, torch.zeros(3))
    with pytest.raises(ValueError, match="optimizer state key 'momentum'"):
        deepspeed.utils.safe_get_full_optimizer_state(engine.module[2].weight, "momentum")
    with pytest.raises(NotBuiltError, match="reduced partitions"):
        deepspeed.utils.safe_set_full_grad(engine.module[2].weight, torch.zeros(4, 16))
    assert deepspeed.utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(2))) is None
    engine.close()


def test_frozen_engine_forwards_as_the_model_and_is_refused_where_deepspeed_refuses_it():
    """``initialize`` with no optimizer at stage 3: a frozen engine whose forward equals the model's, optimizer
    None; at stage 1 or 2 refused, as DeepSpeed asserts."""
    x = torch.randn(3, 8)
    expected = _model(5)(x)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=_model(5), config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    assert optimizer is None and loader is None and scheduler is None
    with torch.no_grad():
        assert torch.allclose(engine(x), expected, atol=1e-6)
    with pytest.raises(RuntimeError, match="without an optimizer"):
        engine.backward(engine(x).sum())
    engine.close()
    for stage in (1, 2):
        with pytest.raises(ConfigError, match=f"zero stage {stage} requires an optimizer"):
            deepspeed.initialize(model=_model(), config={"train_micro_batch_size_per_gpu": 1,
                                                         "zero_optimization": {"stage": stage}})


def test_engine_face_reads_as_deepspeeds():
    """``engine.config`` is the dict given; ``global_steps`` assignable; unknown names reach the module (DeepSpeed-
    Chat reads ``engine.model``-style attributes); ``tput_timer`` counts; the optimizer face steps only through
    the engine."""
    config = _config(2)
    model = _model()
    model.marker = "mine"
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.config is config and engine.config["zero_optimization"]["stage"] == 2
    assert engine.marker == "mine" and engine.zero_optimization_partition_gradients()
    assert isinstance(optimizer, deepspeed.runtime.base_optimizer.ZeROOptimizer)
    assert isinstance(optimizer, torch.optim.Optimizer) and optimizer.param_groups is optimizer.optimizer.param_groups
    for x in _batches(1):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert engine.global_steps == STEPS and engine.tput_timer.global_step_count == STEPS
    engine.global_steps = 10
    assert engine.engine.global_step == 10
    engine.tput_timer.update_epoch_count()
    assert engine.tput_timer.epoch_count == 1
    with pytest.raises(RuntimeError, match="engine.step"):
        optimizer.step()
    with pytest.raises(AttributeError):
        engine.no_such_attribute
    engine.close()


def test_gathered_parameters_skip_none_and_keep_views_valid():
    """transformers passes a module's ``None`` bias; DeepSpeed-Chat keeps ``p.data`` (``.cpu()`` aliases on the
    CPU) after the block: it still holds the gathered values."""
    model = torch.nn.Linear(8, 4, bias=False)
    expected = model.weight.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(3))
    engine.empty_partition_cache()
    with deepspeed.zero.GatheredParameters([engine.module.weight, engine.module.bias]):
        kept = engine.module.weight.data.cpu()
    assert engine.module.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert torch.equal(kept.clone(), expected)
    engine.close()


def _comm():
    import zero_offload.deepspeed.comm as dist
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    m = torch.tensor([float(rank + 1)])
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out = torch.empty(2)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]))
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=1)
    dist.barrier()
    return [t.item(), m.item(), out.tolist(), objects, box[0], dist.get_world_size(), dist.get_local_rank()]


def test_comm_collectives_take_deepspeeds_names_and_reduce_ops():
    r0, r1 = run_ranks(_comm, 2)
    assert r0[:6] == r1[:6] == [3.0, 2.0, [0.0, 1.0], [{"rank": 0}, {"rank": 1}], "from 1", 2]
    assert (r0[6], r1[6]) == (0, 1)


def test_accelerator_and_its_errors(monkeypatch):
    from zero_offload.deepspeed.accelerator import real_accelerator
    acc = deepspeed.get_accelerator()
    assert acc.device_name() in ("cpu", "cuda") and acc.is_available()
    assert acc.FloatTensor([1.0]).dtype == torch.float32 and acc.on_accelerator(torch.ones(1, device=acc.device()))
    monkeypatch.setattr(real_accelerator, "_ACCELERATOR", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'"):
        real_accelerator.get_accelerator()


def test_checkpointing_recomputes_exactly_and_tracks_rng_states():
    ckpt = deepspeed.checkpointing
    assert not ckpt.is_configured() or True
    from zero_offload.offload import checkpoint_offload
    ckpt.configure(None, checkpoint_in_cpu=True)          # engines built from now on offload checkpoint inputs
    assert ckpt.is_configured() and checkpoint_offload.requested()
    ckpt.configure(None, checkpoint_in_cpu=False)
    assert not checkpoint_offload.requested()
    layer = _model()
    x = torch.randn(2, 8, requires_grad=True)
    ckpt.checkpoint(layer, x).sum().backward()
    recomputed = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    layer(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(recomputed, layer.parameters()))
    ckpt.model_parallel_cuda_manual_seed(7)
    tracker = ckpt.get_cuda_rng_tracker()
    with tracker.fork():
        a = torch.rand(3)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("model-parallel-rng", 1)
    ckpt.model_parallel_cuda_manual_seed(7)
    with tracker.fork():
        assert torch.equal(torch.rand(3), a)


def test_zero_to_fp32_reads_our_checkpoints(tmp_path):
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(2))
    for x in _batches(1):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.save_checkpoint(tmp_path)
    full = engine.engine.full_state_dict()
    engine.close()
    from zero_offload.deepspeed.utils import zero_to_fp32
    got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert set(got) == set(full) and all(torch.equal(got[k], full[k]) for k in full)
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(tmp_path, tmp_path / "out", safe_serialization=True)
    from safetensors.torch import load_file
    assert all(torch.equal(t, full[k]) for k, t in load_file(tmp_path / "out" / "model.safetensors").items())
    loaded = zero_to_fp32.load_state_dict_from_zero_checkpoint(_model(9), tmp_path)
    assert torch.equal(loaded[0].weight, full["0.weight"])
    with pytest.raises(FileNotFoundError, match="model states file"):
        zero_to_fp32.get_model_state_file(tmp_path, 2)


def test_client_optimizers_of_deepspeed_ops_and_their_errors():
    model = _model()
    fused = deepspeed.ops.adam.FusedAdam(model.parameters(), lr=LR, weight_decay=WD)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=fused, config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}})
    assert optimizer.param_groups[0]["lr"] == LR and optimizer.param_groups[0]["adamw_mode"] is True
    engine.close()
    with pytest.raises(ValueError, match="bias_correction=False"):
        deepspeed.ops.adam.FusedAdam(model.parameters(), bias_correction=False)
    with pytest.raises(ValueError, match="amsgrad=True"):
        deepspeed.ops.adagrad.DeepSpeedCPUAdagrad(model.parameters(), amsgrad=True)
    with pytest.raises(NotBuiltError, match="DeepSpeedCPULion"):
        deepspeed.ops.lion.DeepSpeedCPULion(model.parameters())


def test_lr_schedules_take_deepspeeds_keywords_and_name_a_bad_one():
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    sched = deepspeed.runtime.lr_schedules.WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10,
                                                    warmup_type="linear")
    sched.step()
    sched.step()
    assert math.isclose(opt.param_groups[0]["lr"], 0.1 * 1 / 10)
    assert "WarmupCosineLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
    with pytest.raises(ConfigError, match="warmup_type"):
        deepspeed.runtime.lr_schedules.WarmupLR(opt, warmup_type="cubic")


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_reads_deepspeeds_checkpoints_as_deepspeeds_own(tmp_path, stage):
    """A ZeRO checkpoint DeepSpeed 0.19.8 wrote (2 ranks): the face's ``get_fp32_state_dict_from_zero_checkpoint``
    gives every tensor DeepSpeed's own function gives, bit for bit, reading no pickle that could run code."""
    pytest.importorskip("deepspeed")
    from deepspeed_peer import ds_train_and_save
    path = str(tmp_path / "ds")
    run_ranks(ds_train_and_save, 2, path, stage, False)
    from zero_offload.deepspeed.utils import zero_to_fp32
    ours = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(path)
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as theirs_of
    theirs = theirs_of(path)
    assert set(theirs) <= set(ours), set(theirs) ^ set(ours)
    assert all(torch.equal(ours[k].float(), theirs[k].float()) for k in theirs)


def _read_grads(stage: int):
    """On each of 2 ranks: one boundary backward, then every parameter's full and local reduced gradient."""
    rank = torch.distributed.get_rank()
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    x = _batches(2)[0]
    engine.backward(engine(x[rank * 4:(rank + 1) * 4]).pow(2).mean())
    full = {n: deepspeed.utils.safe_get_full_grad(p).cpu() for n, p in engine.module.named_parameters()}
    local = {n: deepspeed.utils.safe_get_local_grad(p).numel() for n, p in engine.module.named_parameters()}
    engine.step()
    engine.close()
    return full, local


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_gradient_between_backward_and_step_is_torchs(stage):
    """``safe_get_full_grad`` after the boundary backward: the gradient averaged over both ranks' halves, equal to
    plain torch's over the whole batch; the local pieces add up to the whole (stages 1-3)."""
    ranks = run_ranks(_read_grads, 2, stage)
    ref = _model()
    ref(_batches(2)[0]).pow(2).mean().backward()
    for full, _ in ranks:
        for name, p in ref.named_parameters():
            assert torch.allclose(full[name], p.grad, atol=1e-6), name
    if stage > 0:
        for name, p in ref.named_parameters():
            assert sum(r[1][name] for r in ranks) == p.numel(), name
