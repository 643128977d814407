"""`gpu_validate`'s ``largest_planned`` section (issue 42, item 4): the largest GPT-2-shaped model that
``zero-offload estimate --largest --allow-bf16-masters`` names for this GPU and host, trained with the plan's own
config for a few steps.

It reports what the estimate promised beside what the run measured: parameters, tokens/s and MFU (6 N x tokens/s
against the bf16 matmul peak measured here), peak device memory against ``estimate_memory``'s device bytes, and
peak host RSS against the estimate's host bytes (the issue's target: within 5 %, MFU >= 0.45).

On the CPU (``--tiny``, the smoke run) the search is skipped: a tiny GPT is planned for a small box and trained
the same way, so the path cannot rot.
"""
from __future__ import annotations

import json
from pathlib import Path

import gpu_measure as gm

__all__ = ["section_largest_planned"]

TINY_BOX = {"gpu_memory": "2GB", "host_memory": "8GB"}
STEPS = 2


def _box(args) -> dict:
    """This machine's device and host memory (the planner's capacity), or the tiny box on the CPU."""
    if args.tiny:
        return dict(TINY_BOX)
    import psutil
    import torch
    return {"gpu_memory": torch.cuda.get_device_properties(0).total_memory,
            "host_memory": psutil.virtual_memory().total}


def section_largest_planned(args, matmul_peak) -> dict:
    """Find the largest model (bf16 masters allowed), train it with its plan, compare with the estimate.
    ``matmul_peak(device, tiny)``: the bf16 matmul FLOP/s of this device."""
    import torch
    from zero_offload.estimate import estimate_memory, plan
    from zero_offload.estimate.largest import largest
    from zero_offload.presets import count_parameters
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    box = _box(args)
    calibration = Path(args.out) / "calibration.json"
    calibration = calibration if calibration.exists() else None
    if args.tiny:
        from zero_offload.train.model import GPTConfig
        shape = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64,
                          activation_checkpointing=True)
        chosen = plan(shape, 1, box["gpu_memory"], box["host_memory"], micro_batch=2, gradient_accumulation=1,
                      allow_bf16_masters=True, allow_bf16_moments=True, timed=False)
        found = {"params": count_parameters(shape).total, "predicted_mfu": None}
    else:
        answer = largest(1, box["gpu_memory"], box["host_memory"], allow_bf16_masters=True, allow_bf16_moments=True,
                         calibration=calibration)
        if answer is None:
            return {"ok": False, "error": "no GPT-2-shaped model fits this machine", "box": box}
        shape, chosen = answer.shape, answer.plan
        found = {"params": answer.params, "predicted_mfu": answer.mfu}
    if not chosen.fits:
        return {"ok": False, "error": chosen.message(), "box": box}
    config = chosen.config
    est = estimate_memory(shape, config, micro_batch=config["train_micro_batch_size_per_gpu"],
                          accelerator=device.type == "cuda")
    peak = matmul_peak(device, args.tiny)
    sharded = config["zero_optimization"]["stage"] == 3
    result = gm.run_engine(shape, config, device, steps=1 if args.tiny else STEPS, split_steps=1, sharded=sharded,
                           profile=False)
    result.pop("memory_breakdown", None)
    timing = chosen.batch.timing if chosen.batch is not None else None
    host_need = est.need()["host"]
    out = {"box": {k: int(v) if not isinstance(v, str) else v for k, v in box.items()}, "plan": chosen.name,
           "config": config, "shape": {k: getattr(shape, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size",
                                                                       "block_size")},
           **found, "measured": {k: result.get(k) for k in ("params", "tokens_per_s", "step_s", "peak_device_bytes",
                                                            "peak_rss_bytes", "host_state_bytes", "losses_all_steps",
                                                            "native_kernel")},
           "estimate": {"device_bytes": est.device_bytes, "host_bytes": host_need,
                        "predicted_step_s": timing.step_s if timing else None},
           "matmul_peak_flops": peak}
    out["mfu"] = result["flops_per_token"] * result["tokens_per_s"] / peak
    out["device_over_estimate"] = result["peak_device_bytes"] / est.device_bytes if est.device_bytes else None
    out["rss_over_estimate"] = result["peak_rss_bytes"] / host_need if host_need else None
    out["ok"] = bool(result["tokens_per_s"] > 0)
    return json.loads(json.dumps(out, default=str))
