"""Train a LightningModule on zero-offload: ZeRO stage 2 with the optimizer offloaded to the host, checkpoints
through ModelCheckpoint (sharded directories), no DeepSpeed installed.

    python examples/lightning_zero_offload.py --out /tmp/lit-zero --epochs 2
"""
import argparse

import lightning as L
import torch
import torch.nn.functional as F

from zero_offload.lightning import ZeroOffloadStrategy


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):      # kept: its param groups and learning rate drive the engine's step
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="lit-zero-offload")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(config=config), accelerator="cpu", devices=1,
                        max_epochs=args.epochs, accumulate_grad_batches=2, gradient_clip_val=1.0,
                        default_root_dir=args.out, logger=False, enable_progress_bar=False)
    module = Regressor()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    print(f"trained {trainer.global_step} steps, last loss {float(trainer.callback_metrics['train_loss']):.4f}; "
          f"checkpoint: {trainer.checkpoint_callback.best_model_path}")


if __name__ == "__main__":
    main()
