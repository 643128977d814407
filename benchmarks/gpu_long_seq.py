"""`gpu_validate`'s ``long_seq`` section (issue 58, item 5): Llama 3 8B's shape at the longest sequence the planner
names for this GPU and host (`zero_offload.estimate.longest`), trained one step with ALST's parts as the plan counts
them, the measured peaks against the prediction.

The parts: the plan's config at that length (ZeRO with the optimizer offloaded, activation checkpointing with
the block inputs in host memory, or split between device and host where it chose
``cpu_checkpointing_device_inputs``), every MLP and RMSNorm sequence-tiled (`TiledMLP`, `tile_rms_norms`) and the
logits and loss tiled (`TiledFusedLogitsLoss`), in the tile counts ``longest`` chose. One device: no Ulysses. The
step runs ALST's path: the decoder, then the tiled head.

A step at the longest length is predicted at about 15 minutes on an H100 (549K tokens: attention's FLOPs are 9x
the rest), more than a call allows: where the predicted step exceeds `BUDGET_S` the section trains at the length
whose predicted step fits (attention makes the step grow about as the square of the length), planned again there,
and reports both lengths.

Reported: the longest length and the one trained, the plan, the tile counts, the step time against the predicted
one (a single step, no warm-up), peak device memory against the estimate's device bytes, peak host RSS against its
host bytes, and the loss (finite: ``ok``). The section needs its own call (`LIMIT_S`).

On the CPU (``--tiny``, the smoke run) a tiny Llama is sized for a small box so that the same path runs in seconds.
"""
from __future__ import annotations

import json
import math
import time

import gpu_measure as gm
from gpu_trainer import LLAMA_8B, TINY_LLAMA

__all__ = ["section_long_seq", "LIMIT_S"]

LIMIT_S = 540
BUDGET_S = 240          # the longest predicted step trained in a call (building the 8B model takes minutes too)
TINY_BOX = {"gpu_memory": "64MB", "host_memory": "8GB"}


def _build(tiny: bool, device):
    import torch
    import transformers
    cfg = transformers.LlamaConfig(**(TINY_LLAMA if tiny else LLAMA_8B), attn_implementation="sdpa")
    cfg.max_position_embeddings = 1 << 24          # rotary positions beyond the pretraining context
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model.train()


def section_long_seq(args) -> dict:
    """Plan the longest sequence, train one step at it, measure (see the module docstring)."""
    import psutil
    import torch
    import zero_offload
    from zero_offload.estimate.longest import STEP, longest, tiles_for
    from zero_offload.estimate.planner import plan
    from zero_offload.tiling import tile_gated_mlps, tile_rms_norms
    from zero_offload.estimate.shape import model_shape
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    box = dict(TINY_BOX) if args.tiny else {"gpu_memory": torch.cuda.get_device_properties(0).total_memory,
                                              "host_memory": psutil.virtual_memory().total}
    rss = gm.RssPeak()
    try:
        model = _build(args.tiny, device)
        shape = model_shape(model)
        found = longest(shape, 1, box["gpu_memory"], box["host_memory"])
        if found is None:
            return {"ok": False, "error": "not even 1024 tokens fit", "box": box}
        seq, tiles, chosen = found.seq_len, found.tiles, found.plan
        predicted = chosen.batch.timing.step_s if chosen.batch.timing is not None else None
        if predicted is not None and predicted > BUDGET_S:
            seq = max(STEP, int(seq * math.sqrt(BUDGET_S / predicted)) // STEP * STEP)
            tiles = tiles_for(shape, seq)
            chosen = plan(shape, 1, box["gpu_memory"], box["host_memory"], seq_len=seq, activation_checkpointing=True,
                          tiles=tiles)
            predicted = chosen.batch.timing.step_s if chosen.batch.timing is not None else None
        config = chosen.config
        tile_gated_mlps(model, tiles.mlp)
        tile_rms_norms(model, tiles.norms)
        engine = zero_offload.initialize(model, config)
        try:
            ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device,
                                generator=torch.Generator(device).manual_seed(0))
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            module = engine.module
            # ALST's path: the decoder's hidden states, then the tiled head (the full logits never exist); the
            # checkpoint offload's hooks sit on the decoder module itself
            hidden = module.model(input_ids=ids, use_cache=False).last_hidden_state
            loss = _tiled_loss(module, hidden, ids, tiles.loss)
            engine.backward(loss)
            engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_s = time.perf_counter() - start
            peak_device = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            loss_value = loss.item()
        finally:
            engine.close()
        est = chosen.batch.estimate if chosen.batch is not None else None
    finally:
        peak_rss = rss.stop()
        gm.free()
    device_est = est.device_bytes if est is not None else None
    host_est = est.need()["host"] if est is not None else None
    out = {"box": {k: str(v) for k, v in box.items()}, "longest": found.seq_len, "seq_len": seq, "plan": chosen.name,
           "activation_checkpointing": config.get("activation_checkpointing"),
           "tiles": {"loss": tiles.loss, "mlp": tiles.mlp, "norms": tiles.norms}, "step_s": step_s,
           "predicted_step_s": predicted, "loss": loss_value,
           "measured": {"peak_device_bytes": peak_device, "peak_rss_bytes": peak_rss},
           "estimate": {"device_bytes": device_est, "host_bytes": host_est},
           "device_over_estimate": peak_device / device_est if peak_device and device_est else None,
           "rss_over_estimate": peak_rss / host_est if host_est else None}
    out["ok"] = math.isfinite(loss_value) and step_s > 0
    return json.loads(json.dumps(out, default=str))


def _tiled_loss(module, hidden, ids, tiles: int):
    import torch.nn.functional as F
    from zero_offload.tiling import TiledFusedLogitsLoss
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]

    def loss_sum(self, h, y):
        return F.cross_entropy(self.lm_head(h).float(), y, ignore_index=-100, reduction="sum")
    return TiledFusedLogitsLoss.apply(loss_sum, module, hidden, labels, None, tiles, [module.lm_head.weight],
                                      "sum") / (labels != -100).sum()
