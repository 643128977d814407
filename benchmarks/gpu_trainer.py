"""`gpu_validate`'s ``llama_trainer`` section (issue 41, item 5): a model of Llama 3 8B's shape (32 layers, hidden
4096, intermediate 14336, 32 heads with 8 KV heads, vocabulary 128256; random init, bf16, built on the device)
trained through `zero_offload.hf.Trainer` with the planner's exact plan (no delayed update).

Reported beside each other: tokens/s over the timed steps (the first step is a warm-up), MFU, peak device memory
against ``estimate_memory``'s device bytes for that config (the issue's target: within 5 %), peak host RSS against
the estimate's host bytes, and the step model's predicted step and tokens/s against the measured ones. MFU =
(6 N + 12 L q s) x tokens/s / the bf16 matmul peak measured here: N the parameters that multiply (all but the
input embedding, which is a lookup), 12 L q s the attention scores and their use counted over the full s x s
(PaLM, Chowdhery et al. 2022, App. B; causal kernels skip half, so this is the usual upper count); the target is
MFU >= 0.45. ``ok`` says the model trained and every number is finite; the targets are reported as booleans
(``targets``) and do not decide ``ok``.

The sequence is 4096 tokens: Llama 3's own pretraining context is 8192, but the head's fp32 log-probabilities
and their two gradients take 12 x s x 128256 bytes per sequence (6.3 GB at 4096), so at 4096 the planner can
choose among several micro-batches on the device instead of one or two.

On the CPU (``--tiny``, the smoke run) a tiny Llama (2 layers, hidden 64) is planned for the small box
`gpu_planned` plans for (micro-batch 2, no accumulation, without the step model: ``predicted`` is empty) and
trained for two steps the same way, so the path cannot rot.
"""
from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import gpu_measure as gm
from gpu_planned import TINY_BOX

__all__ = ["section_llama_trainer", "LLAMA_8B", "TINY_LLAMA"]

LLAMA_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
            "rope_theta": 500000.0, "tie_word_embeddings": False}
TINY_LLAMA = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": False}
SEQ, TINY_SEQ = 4096, 64
# The first step is a warm-up (allocations, the engine's first step). For an H200 and a 128 GiB host the plan
# predicts about 25 s a step (micro-batch 4, accumulation 9, with the built-in rates): three steps leave the plan's
# recorded steps, the build and the pinned host buffers room in the section's 420 s.
STEPS, TINY_STEPS = 3, 2


def _build(tiny: bool, device):
    """The model in bf16, initialised where it trains (8B in fp32 would be 32 GB on the host), with SDPA
    attention and activation checkpointing on."""
    import torch
    import transformers
    cfg = transformers.LlamaConfig(**(TINY_LLAMA if tiny else LLAMA_8B), attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model.train()


class _Tokens:
    """Random token sequences (``input_ids`` = ``labels``), each drawn from its index: no data on disk."""

    def __init__(self, vocab: int, seq: int, n: int):
        self.vocab, self.seq, self.n = vocab, seq, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        import torch
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _step_clock(device):
    """A TrainerCallback timing each optimizer step (synchronised on CUDA) and resetting the device's peak
    after the warm-up step, so ``peak_steps`` is the timed steps' own."""
    import torch
    import transformers

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.durations: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            if len(self.durations) == 1 and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.durations.append(time.perf_counter() - self.start)
    return Clock()


def _arguments(out: str, micro: int, gas: int, steps: int, lr: float, device):
    """TrainingArguments matching the plan's config (a key the config sets must equal its argument)."""
    import dataclasses
    import transformers
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return transformers.TrainingArguments(
        output_dir=out, bf16=True, per_device_train_batch_size=micro, gradient_accumulation_steps=gas,
        max_steps=steps, learning_rate=lr, report_to=[], save_strategy="no", logging_steps=1,
        dataloader_num_workers=0, use_cpu=device.type == "cpu", **{ckpt: True})


def _flops_per_token(model, seq: int) -> int:
    """6 N + 12 L q s (see the module docstring)."""
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    if not cfg.tie_word_embeddings:
        n -= model.get_input_embeddings().weight.numel()
    q = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return 6 * n + 12 * cfg.num_hidden_layers * q * seq


def _box(tiny: bool) -> dict:
    if tiny:
        return dict(TINY_BOX)
    import psutil
    import torch
    return {"gpu_memory": torch.cuda.get_device_properties(0).total_memory,
            "host_memory": psutil.virtual_memory().total}


def section_llama_trainer(args, matmul_peak) -> dict:
    """Plan, train and measure (see the module docstring); ``matmul_peak(device, tiny)``: this device's bf16
    matmul FLOP/s."""
    import torch
    from zero_offload.estimate import plan
    from zero_offload.hf import Trainer
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    seq, steps = (TINY_SEQ, TINY_STEPS) if args.tiny else (SEQ, STEPS)
    box = _box(args.tiny)
    calibration = Path(args.out) / "calibration.json"
    peak_flops = matmul_peak(device, args.tiny)
    rss = gm.RssPeak()
    try:
        model = _build(args.tiny, device)
        rss_model = rss.peak
        # counted before training: at stage 3 a released parameter has no elements
        params, flops = sum(p.numel() for p in model.parameters()), _flops_per_token(model, seq)
        # The tiny box: a fixed batch and no step model, whose recorded steps (one per structure the rows reach)
        # would take most of the smoke run's time; the GPU run predicts its step.
        fixed = {"micro_batch": 2, "gradient_accumulation": 1, "timed": False} if args.tiny else {}
        chosen = plan(model, 1, box["gpu_memory"], box["host_memory"], seq_len=seq, activation_checkpointing=True,
                      calibration=calibration if calibration.exists() else None, **fixed)
        if not chosen.fits:
            return {"ok": False, "error": chosen.message(), "box": box}
        config, batch = chosen.config, chosen.batch
        micro, gas = config["train_micro_batch_size_per_gpu"], config.get("gradient_accumulation_steps", 1)
        clock = _step_clock(device)
        lr = config["optimizer"]["params"]["lr"]
        with tempfile.TemporaryDirectory() as out:
            trainer = Trainer(model=model, args=_arguments(out, micro, gas, steps, lr, device),
                              train_dataset=_Tokens(model.config.vocab_size, seq, micro * gas * steps),
                              ds_config=config, callbacks=[clock])
            try:
                result = trainer.train()
            finally:
                if trainer.engine is not None:
                    trainer.engine.close()       # its host threads joined before the next section
        timings = dict(trainer.engine.timings)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        peak_steps = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        del trainer, model
    finally:
        peak_rss = rss.stop()
        gm.free()
    timed = clock.durations[1:]
    tokens_per_s = micro * gas * seq * len(timed) / sum(timed)
    est, timing = batch.estimate, batch.timing
    mfu = flops * tokens_per_s / peak_flops
    host_need = est.need()["host"]
    measured = {"tokens_per_s": tokens_per_s, "step_s": sum(timed) / len(timed), "step_s_each": clock.durations,
                "peak_device_bytes_steps": peak_steps, "peak_rss_bytes": peak_rss,
                "rss_peak_after_model_bytes": rss_model, "losses": losses, "train_loss": result.training_loss,
                "engine_timings": timings}
    out = {"box": {k: int(v) if not isinstance(v, str) else v for k, v in box.items()}, "plan": chosen.name,
           "reasons": chosen.reasons, "config": config, "seq_len": seq, "micro_batch": micro,
           "gradient_accumulation": gas, "params": params,
           "flops_per_token": flops, "matmul_peak_flops": peak_flops, "mfu": mfu, "measured": measured,
           "estimate": {"device_bytes": est.device_bytes, "host_bytes": host_need, "device": est.device,
                        "activations_formula": est.formulas.get("activations")},
           "predicted": {"step_s": timing.step_s if timing else None,
                         "tokens_per_s": timing.tokens_per_s if timing else None,
                         "exposed_share": timing.exposed_share if timing else None}}
    out["device_over_estimate"] = peak_steps / est.device_bytes if peak_steps and est.device_bytes else None
    out["rss_over_estimate"] = peak_rss / host_need if host_need else None
    out["measured_over_predicted_tokens_per_s"] = tokens_per_s / timing.tokens_per_s if timing else None
    over = out["device_over_estimate"]
    out["targets"] = {"mfu_at_least_0.45": mfu >= 0.45,
                      "device_memory_within_5pct": over is not None and abs(over - 1) <= 0.05}
    numbers = [tokens_per_s, mfu, *losses]
    out["ok"] = bool(len(timed) >= 1 and tokens_per_s > 0 and all(math.isfinite(x) for x in numbers))
    return json.loads(json.dumps(out, default=str))
