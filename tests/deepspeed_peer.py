"""DeepSpeed as a peer in tests (issue 30): the same small GPT (GPT-2's layout at toy size: the head tied to the
token embedding, decay and no-decay param groups), data, AdamW and warm-up schedule run under DeepSpeed (CPU
accelerator, gloo, inside `dist_utils.run_ranks`), under zero-offload, and under plain ``torch.optim.AdamW``
(the reference every result is compared with). DeepSpeed is imported only inside the ranks, so a test module
imports this one whether DeepSpeed is installed or not."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch

import zero_offload
from zero_offload.config import WarmupLRParams
from zero_offload.optim.lr_schedules import WarmupLR
from zero_offload.presets import GPTConfig
from zero_offload.train.model import GPT

LR, WD, N, M, BATCH = 1e-3, 0.01, 3, 2, 4
SCHEDULE = {"warmup_min_lr": 1e-4, "warmup_max_lr": LR, "warmup_num_steps": 10}   # mid-warm-up at N and N + M

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install --no-build-isolation deepspeed)")


SHAPE = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32)


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(SHAPE)


def groups(model: GPT, grouped: bool = True) -> list[dict]:
    """Decay on matrices and the tied embedding, none on biases and LayerNorm weights; or (``grouped`` False) one
    group, all decayed."""
    return model.optimizer_groups(WD) if grouped else [{"params": list(model.parameters()), "weight_decay": WD}]


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, SHAPE.vocab_size, (BATCH, SHAPE.block_size + 1), generator=g) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def my_half(batch, rank: int, world: int):
    part = batch[0].shape[0] // world
    return tuple(t[rank * part:(rank + 1) * part] for t in batch)


def loss_of(model, batch) -> torch.Tensor:
    return model(*batch)[1]


def reference(steps: int = N + M, grouped: bool = True) -> dict[str, torch.Tensor]:
    """Plain AdamW with the same warm-up and groups, on one process and the whole batch."""
    model = make_model()
    opt = torch.optim.AdamW(groups(model, grouped), lr=LR, weight_decay=WD)
    schedule = WarmupLR(opt, WarmupLRParams(**SCHEDULE))
    for batch in batches(steps):
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def ds_config(stage: int, offload: bool, universal: bool = False) -> dict:
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zc["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": zc, "zero_force_ds_cpu_optimizer": False,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": SCHEDULE}}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def our_config(stage: int, offload: bool) -> dict:
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zc["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0.0, "zero_optimization": zc,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "scheduler": {"type": "WarmupLR", "params": SCHEDULE}}


def _deepspeed_engine(config: dict, grouped: bool = True):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups(model, grouped), config=config)
    return deepspeed, engine


def _ds_full_parameters(deepspeed, engine) -> dict[str, torch.Tensor]:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def ds_train_and_save(path: str, stage: int, offload: bool) -> dict[str, torch.Tensor]:
    """On every rank: DeepSpeed trains N steps, saves ``path`` (client_state {"epoch": 7}), trains M more;
    returns its uninterrupted N + M run's full parameters."""
    import torch.distributed as dist
    deepspeed, engine = _deepspeed_engine(ds_config(stage, offload))
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, x in enumerate(batches(N + M)):
        if i == N:
            engine.save_checkpoint(path, client_state={"epoch": 7})
        engine.backward(loss_of(engine, my_half(x, rank, world)))
        engine.step()
    return _ds_full_parameters(deepspeed, engine)


def ds_resume(path: str, stage: int, offload: bool, grouped: bool = True) -> dict[str, torch.Tensor]:
    """On every rank: DeepSpeed resumes the universal checkpoint at ``path`` and trains M steps."""
    import torch.distributed as dist
    deepspeed, engine = _deepspeed_engine(ds_config(stage, offload, universal=True), grouped)
    rank, world = dist.get_rank(), dist.get_world_size()
    engine.load_checkpoint(path)
    assert engine.global_steps == N, engine.global_steps
    for x in batches(N + M)[N:]:
        engine.backward(loss_of(engine, my_half(x, rank, world)))
        engine.step()
    return _ds_full_parameters(deepspeed, engine)


def to_universal(path: str) -> None:
    """DeepSpeed's own ``ds_to_universal.py`` on the checkpoint at ``path`` (tag ``global_stepN``), written
    beside it as ``path + "-universal"``."""
    tag = f"global_step{N}"
    out = f"{path}-universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    f"{path}/{tag}", "--output_folder", f"{out}/{tag}", "--inject_missing_state"],
                   check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})


def scrambled_engine(model: torch.nn.Module, config: dict, model_parameters=None):
    """An engine of ``model`` with every parameter overwritten at random first: a load must replace every value."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zero_offload.initialize(model, config, model_parameters)


def ours_resume(path: str, stage: int, offload: bool, rank: int = 0, world: int = 1, **flags):
    """zero-offload resumes ``path`` and trains M steps: (full parameters, the returned client_state)."""
    model = make_model()
    engine = scrambled_engine(model, our_config(stage, offload), groups(model))
    try:
        client_state = engine.load_checkpoint(path, **flags)
        assert engine.global_step == N
        for x in batches(N + M)[N:]:
            engine.backward(loss_of(engine, my_half(x, rank, world)))
            engine.step()
        return engine.full_state_dict(), client_state
    finally:
        engine.close()


def ours_resume_on_ranks(path: str, stage: int, offload: bool):
    import torch.distributed as dist
    return ours_resume(path, stage, offload, dist.get_rank(), dist.get_world_size())


def ours_train_and_save(path: str, stage: int, offload: bool, grouped: bool = True) -> None:
    """On every rank: zero-offload trains N steps and writes DeepSpeed's universal layout at ``path``."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make_model()
        engine = zero_offload.initialize(model, our_config(stage, offload), groups(model, grouped))
    try:
        for x in batches(N):
            engine.backward(loss_of(engine, my_half(x, rank, world)))
            engine.step()
        engine.save_checkpoint(path, format="deepspeed-universal")
    finally:
        engine.close()


def max_diff(a: dict, b: dict) -> float:
    assert set(a) >= set(b), sorted(set(b) - set(a))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)
