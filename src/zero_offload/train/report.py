"""What the training job leaves behind for a person: the loss plot, the measured step timeline and a text
sample."""
from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["plot_losses", "StepTimes", "step_times", "plot_step_times", "write_sample"]

# The stacked phases of a step, from `Engine.timings` (`zero_offload.runtime.step_timer`): the optimizer phase less
# the host step it waited for, that exposed host step, and what ``step_s`` holds beyond the three phases.
PHASES = ("forward", "backward", "optimizer, less the host step", "exposed host step", "other")
PHASE_COLOURS = ("#4c72b0", "#55a868", "#8172b3", "#c44e52", "#bbbbbb")


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


@dataclass
class StepTimes:
    """The measured phases `plot_step_times` drew, in seconds.

    Attributes:
        steps: the optimizer steps that recorded `Engine.timings` (their ``step`` in metrics.jsonl).
        wall: {phase (`PHASES`): [seconds per step]}: the host's wall clock (``forward_s``, ``backward_s``,
            ``optimizer_s - exposed_host_step_s``, ``exposed_host_step_s``, ``step_s`` less the three phases).
        device: the same from CUDA events (``device_*``); empty where none were recorded (no GPU).
        host_step: [seconds per step] of the host step on its own thread (``host_step_s``, hidden or not); empty
            where the optimizer steps on the device.
        median_step: the step of median ``step_s``, drawn as the lower panel.
    """
    steps: list[int]
    wall: dict[str, list[float]]
    device: dict[str, list[float]] = field(default_factory=dict)
    host_step: list[float] = field(default_factory=list)
    median_step: int = 0


def step_times(metrics_path: Path) -> StepTimes | None:
    """The per-phase times of every step metrics.jsonl recorded `Engine.timings` for; None where none did.

    Raises:
        OSError: the file cannot be read; ValueError: a line is not JSON.
    """
    recs = [r for r in map(json.loads, Path(metrics_path).read_text().splitlines())
            if isinstance(r.get("step_s"), (int, float)) and r["step_s"] > 0]
    if not recs:
        return None

    def phases(r: dict, prefix: str) -> list[float]:
        get = lambda key: float(r.get(prefix + key) or 0.0)
        f, b, o, e = get("forward_s"), get("backward_s"), get("optimizer_s"), get("exposed_host_step_s")
        return [f, b, max(0.0, o - e), e, max(0.0, get("step_s") - f - b - o)]

    def columns(prefix: str) -> dict[str, list[float]]:
        rows = [phases(r, prefix) for r in recs]
        return {name: [row[i] for row in rows] for i, name in enumerate(PHASES)}
    device = columns("device_") if all(r.get("device_step_s") for r in recs) else {}
    host = [float(r["host_step_s"]) for r in recs] if all("host_step_s" in r for r in recs) else []
    median = statistics.median_low(r["step_s"] for r in recs)
    return StepTimes([int(r["step"]) for r in recs], columns(""), device, host,
                     next(int(r["step"]) for r in recs if r["step_s"] == median))


def plot_step_times(metrics_path: Path, png_path: Path) -> StepTimes | None:
    """The measured step timeline from metrics.jsonl as a PNG (matplotlib's Agg canvas): above, one stacked bar
    per recorded step of its phases (`PHASES`, seconds; on a GPU the device's CUDA-event times beside the host's
    wall clock), with the host step's own duration on its thread where it ran on the host; below, the median step's
    phases as one bar per clock. The phases are sums over the step's micro-steps, not their order.

    Returns:
        What was drawn (`StepTimes`, the bars read back from the figure), or None -- and nothing written --
        where no step recorded its timings.

    Raises:
        OSError: a file cannot be read or written; ValueError: a line of metrics.jsonl is not JSON.
    """
    times = step_times(metrics_path)
    if times is None:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg     # imported here: only a plot needs it
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, height_ratios=[2.2, 1])
    clocks = [("host wall clock", times.wall)] + ([("device (CUDA events)", times.device)] if times.device else [])
    width = 0.8 / len(clocks)
    for c, (clock, cols) in enumerate(clocks):
        x = [s + (c - (len(clocks) - 1) / 2) * width for s in times.steps]
        base = [0.0] * len(times.steps)
        for name, colour in zip(PHASES, PHASE_COLOURS):
            top.bar(x, cols[name], width, bottom=base, color=colour, linewidth=0, alpha=1.0 if c == 0 else 0.6,
                    label=name if c == 0 else None, gid=f"{c}|{name}")
            base = [b + v for b, v in zip(base, cols[name])]
    if times.host_step:
        top.plot(times.steps, times.host_step, "k.", markersize=4, label="host step on its thread\n(hidden or not)")
    top.set_xlabel("optimizer step" + ("  (left bar: host wall clock, right: device)" if times.device else ""))
    top.set_ylabel("seconds")
    top.set_title("measured step phases (engine.timings), summed over each step's micro-steps", fontsize=10)
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    top.grid(axis="y", alpha=0.3)
    i = times.steps.index(times.median_step)
    for row, (clock, cols) in enumerate(clocks):
        left = 0.0
        for name, colour in zip(PHASES, PHASE_COLOURS):
            bottom.barh(row, cols[name][i], left=left, color=colour, height=0.6)
            left += cols[name][i]
    bottom.set_yticks(range(len(clocks)), [c for c, _ in clocks], fontsize=8)
    bottom.invert_yaxis()
    bottom.set_xlabel("seconds")
    bottom.set_title(f"median step ({times.median_step}): its phases in order forward, backward, optimizer, exposed "
                     "host step, other (summed, not interleaved)", fontsize=9)
    fig.savefig(png_path)
    return drawn(top, times, len(clocks))


def drawn(ax, times: StepTimes, clocks: int) -> StepTimes:
    """``times`` with its per-step phases read back from the bars of ``ax`` (each bar's ``gid``: clock index and
    phase), in step order: what the upper panel shows."""
    bars: dict[str, list[tuple[float, float]]] = {}
    for patch in ax.patches:
        if patch.get_gid():
            bars.setdefault(patch.get_gid(), []).append((float(patch.get_x()), float(patch.get_height())))
    read = [{name: [h for _, h in sorted(bars.get(f"{c}|{name}", []))] for name in PHASES} for c in range(clocks)]
    return dataclasses.replace(times, wall=read[0], device=read[1] if clocks > 1 else {})


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
