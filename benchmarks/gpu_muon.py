"""`gpu_validate`'s ``muon`` section (issue 43, item 7): GPT-2 124M and GPT-2 XL trained with Muon.

Beside each other in one call: plain ``torch.optim.Muon`` (the 2-D matrices) with ``torch.optim.AdamW(fused=True)``
(the rest), fp32 weights and bf16 autocast on the device, against the engine with the same two optimizers handed to
it (`zero_offload.compat.muon_client`: ``flavor: "torch"``), bf16, ZeRO stage 2 with the optimizer offloaded to the
CPU. Reported per run: tokens/s, the engine's against plain Muon's (the issue's target: >= 0.8x for GPT-2 XL), peak
device memory and the engine's model-state bytes on the device (target: less than half of plain Muon's).

On the CPU (``--tiny``, the smoke run) both models are tiny: the path cannot rot.
"""
from __future__ import annotations

import gpu_measure as gm

__all__ = ["section_muon"]

MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
ADAMW = {"lr": 3e-4, "weight_decay": 0.01}


def _optimizers(model):
    import torch
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, fused=rest[0].is_cuda, **ADAMW)]


def _matrix_numel(cfg) -> int:
    import torch
    from zero_offload.train.model import GPT
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters() if p.ndim == 2)


def _engine_config(micro: int) -> dict:
    params = {"flavor": "torch", "muon_lr": MUON["lr"], "momentum": MUON["momentum"],
              "weight_decay": MUON["weight_decay"], "adam_lr": ADAMW["lr"], "betas": [0.9, 0.999], "eps": 1e-8}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "Muon", "params": params},
            "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 50_000_000,
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True}}}


def section_muon(args, gpt_config, device) -> dict:
    """Both models, plain Muon then the engine; ``gpt_config(name, tiny, **shape)`` as `gpu_validate` builds them."""
    models = {"gpt2": (gpt_config("gpt2", args.tiny), 2 if args.tiny else 8),
              "gpt2_xl": (gpt_config("custom", args.tiny, n_layer=48, n_head=25, n_embd=1600, vocab_size=50257,
                                     block_size=1024, activation_checkpointing=True), 2 if args.tiny else 16)}
    steps = 2 if args.tiny else 4
    out = {}
    for name, (cfg, micro) in models.items():
        plain = gm.run_plain(cfg, device, micro, steps, profile=False, optimizers=_optimizers)
        # plain: fp32 weights and gradients, Muon's momentum for the matrices, AdamW's two moments for the rest
        matrices = _matrix_numel(cfg)
        plain["device_model_state_bytes"] = 8 * plain["params"] + 4 * matrices + 8 * (plain["params"] - matrices)
        engine = gm.run_engine(cfg, _engine_config(micro), device, steps, 1, sharded=False, profile=False)
        held = engine.pop("memory_breakdown", {})      # stage 2 + offload: 16-bit parameters and buckets stay
        engine["device_model_state_bytes"] = held.get("params", 0) + held.get("buckets", 0)
        out[name] = {"plain-muon": plain, "stage2-offload-muon": engine,
                     "tokens_per_s_vs_plain": engine["tokens_per_s"] / plain["tokens_per_s"],
                     "model_state_vs_plain": engine["device_model_state_bytes"] / plain["device_model_state_bytes"]}
    return {"models": out, "ok": all(m["stage2-offload-muon"]["tokens_per_s"] > 0 for m in out.values())}
