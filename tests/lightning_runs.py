"""One small Lightning run, on Lightning's default strategy or on ZeroOffloadStrategy, for the Lightning tests and
the torchrun script: `toy_model.ToyTransformer` (tied embeddings, LayerNorm, biases), random tokens, fp32, torch
AdamW with a linear warm-up schedule."""
from __future__ import annotations

import torch

from toy_model import SEQ, VOCAB, ToyTransformer

LR = 1e-3


def make_module(weight_decay: float = 0.1, sched: bool = True, compile_backend: str | None = None):
    import lightning as L

    class LitToy(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = ToyTransformer()
            self.losses: list[float] = []

        def configure_model(self):
            if compile_backend is not None:      # compiled in place, as Lightning's docs suggest doing it here
                self.net.compile(backend=compile_backend)

        def forward(self, x):
            return self.net(x[:, :-1], x[:, 1:])     # the next-token loss

        def training_step(self, batch, batch_idx):
            loss = self(batch[0])
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self(batch[0]))

        def configure_optimizers(self):
            decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
            other = [p for n, p in self.named_parameters() if p.dim() < 2]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                     {"params": other, "weight_decay": 0.0}], lr=LR)
            if not sched:
                return opt
            warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warm, "interval": "step"}}

    return LitToy()


def loader(n: int = 16, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (n, SEQ + 1), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)


def trainer(strategy=None, **overrides):
    import lightning as L
    kw = dict(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=1.0,
              logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=0, use_distributed_sampler=False)
    kw.update(overrides)
    if strategy is not None:
        kw["strategy"] = strategy
    return L.Trainer(**kw)


def config(stage: int, offload_optimizer: bool = False, offload_param: bool = False) -> dict:
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload_optimizer:
        zc["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zc["offload_param"] = {"device": "cpu"}
    return {"zero_optimization": zc}


def weights(module, strategy=None) -> dict:
    """{name: fp32 CPU tensor} of the module's parameters (the engine's masters under ZeroOffloadStrategy)."""
    engine = getattr(strategy, "engine", None)
    if engine is not None:
        return {k: v.float() for k, v in engine.full_state_dict().items()}
    return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)
