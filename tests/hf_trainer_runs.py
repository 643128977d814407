"""One small transformers Trainer run, plain or on zero-offload (``ds_config``), for the Trainer tests and the
torchrun script: tiny GPT-2/Llama from configs (`hf_models.build`), random token data, fp32, torch AdamW."""
from __future__ import annotations

import torch

from hf_models import SEQ, VOCAB, build

LR = 1e-3


class TokenData(torch.utils.data.Dataset):
    """``n`` causal-LM samples {input_ids, labels} of SEQ random tokens (fixed generator)."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(out_dir, **overrides):
    import transformers
    kw = dict(output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_steps=3, learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
              save_strategy="no", report_to=[], seed=0, use_cpu=True, optim="adamw_torch", disable_tqdm=True,
              dataloader_num_workers=0, eval_strategy="no")
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def zero_config(stage: int, offload_optimizer: bool = False, offload_param: bool = False,
                optimizer_section: bool = True) -> dict:
    """A config as users write it for the Trainer: everything the arguments know is ``"auto"``."""
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload_optimizer:
        zc["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zc["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": zc,
           "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
    if optimizer_section:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}
    return cfg


def run(kind: str, out_dir, ds_config: dict | None = None, n_samples: int = 12, resume=None, model=None,
        **overrides):
    """Train ``kind`` with the plain Trainer (``ds_config`` None) or ours; returns (trainer, per-step losses,
    per-step logged lrs, per-step grad norms, {name: fp32 CPU weight})."""
    import transformers

    from zero_offload.hf import Trainer
    model = model if model is not None else build(kind)
    args = training_args(out_dir, **overrides)
    data = TokenData(n_samples)
    if ds_config is None:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data, ds_config=ds_config)
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    weights = weights_of(trainer)
    return (trainer, [h["loss"] for h in logs], [h["learning_rate"] for h in logs],
            [h["grad_norm"] for h in logs], weights)


def weights_of(trainer) -> dict:
    """{name: fp32 CPU tensor} of the trained model (the engine's fp32 masters when it has one)."""
    engine = getattr(trainer, "engine", None)
    if engine is not None:
        return {k: v.float() for k, v in engine.full_state_dict().items()}
    return {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()}


def initial_weights(kind: str) -> dict:
    """{name: fp32 CPU tensor} of ``kind`` as built, before training (to check that training moved it)."""
    return {n: p.detach().float().clone() for n, p in build(kind).named_parameters()}


def max_weight_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)
