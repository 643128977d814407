"""Ulysses sequence parallelism on small Llama and Qwen2 shapes: the runs each rank makes under the engine
(`dist_utils.run_ranks`) and their plain-PyTorch AdamW reference, for tests/test_ulysses.py.

The data: sample ``k * W + r`` (``W`` ranks) is the ``k``-th batch rank ``r``'s DataLoader yields, so under any
sequence-parallel size ``P`` (``W / P`` replicas, gradient accumulation ``P``: the adapter hands a group one loaded
batch per micro-step) optimizer step ``k`` trains samples ``k * W .. k * W + W - 1``: the same global batch as
plain data parallelism, which the reference trains on one process (the mean of the samples' token-mean losses).
Labels are ``-100`` on a prompt of varying length, so the shards' token counts differ.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

SEQ, VOCAB, LR, STEPS = 16, 64, 3e-3, 2
SHAPES = {  # (config class, heads, key/value heads): Llama with GQA 4/2; Qwen2 with one key/value head (replicated)
    "llama": ("LlamaConfig", 4, 2),
    "qwen": ("Qwen2Config", 4, 1),
}


def make_model(shape: str, checkpointing: bool = False, tiled: bool = False):
    import transformers
    cls, heads, kv = SHAPES[shape]
    config = getattr(transformers, cls)(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=heads, num_key_value_heads=kv,
                                        max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    if checkpointing:               # transformers' own offload: the engine moves the block inputs (docs)
        model.activation_checkpointing_enable(offload=True)
    if tiled:                       # every MLP and RMSNorm sequence-tiled, in 2 tiles, under Ulysses
        from zero_offload.tiling import tile_gated_mlps, tile_rms_norms
        tile_gated_mlps(model, 2)
        tile_rms_norms(model, 2)
    return model


def sample(index: int) -> dict:
    g = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :1 + index % 5] = -100               # a prompt the loss ignores
    return {"input_ids": ids, "position_ids": torch.arange(SEQ)[None], "labels": labels}


def reference(shape: str, world: int, steps: int = STEPS) -> tuple[dict, list[float]]:
    """Plain AdamW on one process over each step's ``world`` samples (whole sequences); returns the parameters
    after ``steps`` steps and each step's loss."""
    model = make_model(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for k in range(steps):
        loss = sum(model(**sample(k * world + r)).loss for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def config(stage: int, sp: int, offload: str, checkpointing: bool = False) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 4000, "offload_optimizer": {"device": offload}}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2000)
    out = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": sp, "sequence_parallel_size": sp,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": zero}
    if checkpointing:               # the tiny model's block inputs are far below the default threshold
        out["activation_checkpointing"] = {"cpu_checkpointing_min_bytes": 0}
    return out


def alst_loss(loss, shift_labels, group, size):
    """The loss of DeepSpeed's ALST tutorial: shard losses all-gathered differentiably, token-weighted."""
    import torch.distributed.nn.functional as dnn
    losses = dnn.all_gather(loss, group=group)
    good = (shift_labels != -100).view(-1).sum()
    goods = dnn.all_gather(good, group=group)
    return sum(losses[r] * goods[r] for r in range(size)) / sum(goods)


def run(shape: str, stage: int, sp: int, offload: str = "cpu", loss_style: str = "engine", face: bool = False,
        steps: int = STEPS, save: str | None = None, load: str | None = None, checkpointing: bool = False,
        tiled: bool = False) -> dict:
    """One rank's run: the tutorial's call sequence (register, build, initialize, adapter, loop); returns the
    losses, the parameters after the last step and each step's gradient norm. ``load``: resume from that checkpoint
    directory first (its steps are skipped in the data); ``save``: write one there at the end; ``checkpointing``:
    transformers' activation checkpointing with ``offload=True`` (block inputs in host memory, items 1 and 3);
    ``tiled``: the MLPs sequence-tiled."""
    import zero_offload
    from zero_offload.deepspeed.runtime.sequence_parallel.ulysses_sp import (UlyssesSPAttentionHF,
                                                                             UlyssesSPDataLoaderAdapter)
    from zero_offload.sequence.hf_registration import unregister_from_transformers
    world, rank = dist.get_world_size(), dist.get_rank()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=make_model(shape),
                                                          core_attn_implementation="sdpa",
                                                          sequence_parallel_size=sp, micro_batch_size=1)
    try:
        model = make_model(shape, checkpointing, tiled)
        if face:
            import zero_offload.deepspeed as deepspeed
            cfg = config(stage, sp, offload, checkpointing)
            cfg.pop("sequence_parallel_size")           # the mpu says it
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
            inner = engine.engine if hasattr(engine, "engine") else engine
        else:
            engine = inner = zero_offload.initialize(model, config(stage, sp, offload, checkpointing))
        start = 0
        if load:
            inner.load_checkpoint(load)
            start = inner.global_step
        loader = [sample(k * world + rank) for k in range(start, steps)]
        if sp > 1:
            loader = UlyssesSPDataLoaderAdapter(loader, sp_rank=mpu.get_sequence_parallel_rank(),
                                                sp_group=mpu.get_sequence_parallel_group(), sp_world_size=sp,
                                                device="cpu")
        moved = inner.checkpoint_offload
        losses, norms = [], []
        for micro, batch in enumerate(loader):
            if sp == 1:
                loss = engine(**batch).loss
            else:
                shift = batch.pop("shift_labels")
                logits = engine(**batch).logits
                local = model.loss_function(logits=logits, labels=None, shift_labels=shift, vocab_size=VOCAB)
                loss = (alst_loss(local, shift, mpu.group, sp) if loss_style == "alst"
                        else inner.sequence_parallel_loss(local, shift))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if (micro + 1) % sp == 0:
                norms.append(inner.last_grad_norm)
            if len(losses) == (steps - start) * sp:
                break
        if save:
            inner.save_checkpoint(save)
        params = {n: p.detach().clone() for n, p in inner.full_state_dict().items()}
        inner.close()
        return {"losses": losses, "params": params, "norms": norms,
                "offloaded": moved.counts.offloaded if moved is not None else 0}
    finally:
        unregister_from_transformers("sdpa")
