"""Plain-PyTorch reference runs and the matching engine runs, shared by the numerical tests."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero_offload
from toy_model import batch, make_model

MICRO, STEPS, LR, WD = 2, 5, 3e-3, 0.01


def engine_config(stage=2, offload="none", gas=1, clip=0.0, precision="fp32", ws=1, bucket=500, wd=WD, eps=None,
                  **zero):
    adamw = {"lr": LR, "weight_decay": wd, **({"eps": eps} if eps is not None else {})}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": adamw},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload},
                              "reduce_bucket_size": bucket, "overlap_comm": True, **zero},
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def reference_run(gas=1, clip=0.0, ws=1, steps=STEPS, dtype=torch.float32, loss_scale=1.0, with_norms=False):
    """AdamW on one process over the global batch. With a 16-bit ``dtype`` the model runs in that dtype and
    an fp32 master copy is stepped (the same precision policy as the engine), with a static
    ``loss_scale`` for fp16. Returns (params, losses), and with ``with_norms`` the global gradient norms that
    ``torch.nn.utils.clip_grad_norm_`` returns (before clipping) as a third item."""
    model = make_model().to(dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD)
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step, MICRO * gas * ws)
        model.zero_grad()
        loss = model(x, y)
        (loss * loss_scale).backward()
        losses.append(loss.item())
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float() / loss_scale
        # An infinite clip multiplies by exactly 1.0: the norm is measured, nothing changes.
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, clip if clip > 0 else float("inf"))))
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    params = dict(zip(names, (m.detach().clone() for m in masters)))
    return (params, losses, norms) if with_norms else (params, losses)


def engine_run(config: dict, steps=STEPS, with_norms=False):
    """Train the toy model with the engine on this rank's share of each global batch.

    Returns (full fp32 state from the masters, the module's parameters as fp32, per-step global losses), and
    with ``with_norms`` the per-step ``engine.last_grad_norm`` as a fourth item.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    ws = dist.get_world_size() if dist.is_initialized() else 1
    engine = zero_offload.initialize(make_model(), config)
    losses, norms = [], []
    for step in range(steps):
        losses.append(train_step(engine, step, rank, ws))
        norms.append(engine.last_grad_norm)
    with zero_offload.gathered_parameters(engine.module.parameters()):   # stage 3 holds shards only
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    out = (engine.full_state_dict(), params, losses)
    return (*out, norms) if with_norms else out


def train_step(engine, step: int, rank: int, ws: int) -> float:
    """One optimizer step of ``engine`` on this rank's micro-batches of global batch ``step``; returns the mean
    loss over every rank's micro-batches."""
    gas = engine.gradient_accumulation_steps
    x, y = batch(step, MICRO * gas * ws)
    total = torch.zeros(())
    for k in range(gas):
        rows = slice((rank * gas + k) * MICRO, (rank * gas + k + 1) * MICRO)
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        total += loss.detach().float().cpu() / (gas * ws)
    if ws > 1:
        dist.all_reduce(total)
    return total.item()


def engine_runs(configs: list[dict], steps=STEPS, with_norms=False) -> list:
    return [engine_run(c, steps, with_norms) for c in configs]


def paired_runs(cases: list[tuple], pair) -> dict:
    """Each case's two configs (``pair(case)``) trained at 1 and at 2 ranks: {(world size, *case): (the first's
    run, the second's)}, each as `engine_run` returns it (rank 0's view at 2 ranks)."""
    from dist_utils import run_ranks
    out = {}
    for ws in (1, 2):
        configs = [c for case in cases for c in pair(case)]
        runs = engine_runs(configs) if ws == 1 else run_ranks(engine_runs, 2, configs)[0]
        out.update({(ws, *case): (runs[2 * i], runs[2 * i + 1]) for i, case in enumerate(cases)})
    return out


def assert_matches_adamw(run, ref: dict, ref_losses: list[float], atol: float, bitwise: dict | None = None) -> None:
    """``run`` (`engine_run`'s masters, parameters, losses) within ``atol`` of the AdamW reference, and with
    ``bitwise`` (another run's masters) equal to it bit for bit."""
    masters, params, losses = run[:3]
    for name, value in ref.items():
        assert (masters[name] - value).abs().max().item() <= atol, name
        assert (params[name] - value).abs().max().item() <= atol, name
        if bitwise is not None:
            assert torch.equal(masters[name], bitwise[name]), f"{name}: not bitwise the run it is paired with"
    assert losses == pytest.approx(ref_losses, abs=atol)


def assert_norms_match(norms: list[float], ref_norms: list[float], rel: float = 1e-5) -> None:
    """The engine's global gradient norms equal ``clip_grad_norm_``'s on the reference: fp32 sums of squares in
    other groupings, within ``rel`` relative (measured <= 2e-6 on this model)."""
    for step, (a, b) in enumerate(zip(norms, ref_norms, strict=True)):
        assert abs(a - b) <= rel * b, f"step {step}: global norm {a} against clip_grad_norm_'s {b}"


def one_step_breakdown(config: dict) -> dict:
    """``memory_breakdown()`` of an engine of the toy model under ``config`` after one step."""
    engine = zero_offload.initialize(make_model(), config)
    x, y = batch(0, MICRO)
    engine.backward(engine(x, y))
    engine.step()
    held = engine.memory_breakdown()
    engine.close()
    return held


def assert_estimated(held: dict, config: dict) -> None:
    """The estimate of ``config`` predicts, side by side, every model-state kind ``held`` (a breakdown) holds, to the
    byte (the estimate's working-memory kinds, such as stage 3's gathered parameters, are not held between
    steps)."""
    from zero_offload.estimate import estimate_memory
    from zero_offload.estimate.memory import MODEL_STATE_KINDS
    est = estimate_memory(make_model(), config, 1, accelerator=False)
    for side, predicted in (("device", est.device), ("host", est.host), ("nvme", est.nvme)):
        mine = {k: v["bytes"] for k, v in held.items() if v["side"] == side and v["bytes"]}
        assert {k: v for k, v in predicted.items() if v and k in MODEL_STATE_KINDS} == \
            {k: v for k, v in mine.items() if k in MODEL_STATE_KINDS}, side
