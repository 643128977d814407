"""What the training job leaves behind for a person: the loss plot and a text sample."""
from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["plot_losses", "write_sample"]


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    """Train and validation loss against step, from metrics.jsonl, as a PNG (matplotlib, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = [], []
    for line in Path(metrics_path).read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            train.append((rec["step"], rec["loss"]))
        if "val_loss" in rec:
            val.append((rec["step"], rec["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1, alpha=0.8)
    if val:
        ax.plot(*zip(*val), label="validation", marker="o", linewidth=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title("zero-offload train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


@torch.no_grad()
def write_sample(model, data, path: Path | None, device: torch.device, seed: int, tokens: int = 200) -> str:
    """Generate ``tokens`` tokens after the first 32 validation tokens; save (unless ``path`` is None) and
    return the text."""
    prompt = torch.as_tensor(data.val[:32].astype("int64"))[None].to(device)
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(prompt, tokens, temperature=0.8, top_k=50, generator=gen)
    model.train()
    text = data.decode(out[0].tolist())
    if path is not None:
        Path(path).write_text(text)
    return text
