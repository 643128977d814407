"""The memory model for models with frozen (``requires_grad=False``) parameters, against the engine's own
accounting: whole below stage 3, this rank's shards at stage 3 (`zero.stage3.frozen`), never optimized.
The same model against the process's RSS growth (docs/estimate.md's 10 %): test_process_memory.py."""
from __future__ import annotations

import pytest
import torch

import zero_offload
from dist_utils import run_ranks
from zero_offload.estimate import estimate_memory
from zero_offload.estimate.memory import MODEL_STATE_KINDS, model_shape
from zero_offload.train.model import GPT, GPTConfig

SHAPE = GPTConfig(vocab_size=512, block_size=16, n_layer=2, n_head=4, n_embd=64)


def _lora_like() -> GPT:
    """A GPT whose embeddings and first block are frozen (the base), the rest trained."""
    torch.manual_seed(0)
    model = GPT(SHAPE)
    for name, p in model.named_parameters():
        if name.startswith(("wte", "wpe", "h.0.", "transformer.wte", "transformer.wpe", "transformer.h.0.")):
            p.requires_grad_(False)
    return model


def _config(stage: int, offload_param: bool) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 50_000}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero}


def test_model_shape_splits_frozen_units():
    model = _lora_like()
    shape = model_shape(model)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen > 0 and sum(sum(n) for _, _, n in shape.frozen) == frozen
    assert shape.n_params == sum(p.numel() for p in model.parameters() if p.requires_grad)


def _compare(stage: int, offload_param: bool):
    model = _lora_like()
    cfg = _config(stage, offload_param)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    est = estimate_memory(model, cfg, world, accelerator=False).model_states()
    frozen_bytes = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    engine = zero_offload.initialize(model, cfg)
    x = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.block_size))
    _, loss = engine(x, x)          # moments and buckets exist from the first step on
    engine.backward(loss)
    engine.step()
    measured = {k: v["bytes"] for k, v in engine.memory_breakdown().items() if k in MODEL_STATE_KINDS}
    if stage < 3:      # stages 0-2 keep frozen parameters whole in the module; the engine does not own them
        measured["frozen_params"] = frozen_bytes
    return est, measured


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage,offload_param", [(2, False), (3, False), (3, True)])
def test_frozen_parameters_estimate_matches_the_engine(world_size, stage, offload_param):
    for est, measured in run_ranks(_compare, world_size, stage, offload_param):
        assert est["frozen_params"] == measured["frozen_params"], (est, measured)
        total = sum(measured.values())
        assert abs(sum(est.values()) - total) <= 0.02 * total, (est, measured)
        for kind in set(est) | set(measured):
            assert abs(est.get(kind, 0) - measured.get(kind, 0)) <= 0.02 * total, (kind, est, measured)
