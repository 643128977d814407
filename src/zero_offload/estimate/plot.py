"""`zero-offload estimate --plot FILE`: a plan as a picture.

One figure, two parts. Above, one horizontal stacked bar per memory tier the plan uses (the device, host memory,
NVMe where the plan swaps to it): the memory model's bytes per kind for one rank (`MemoryEstimate`, the same
object the table prints), against the tier's capacity per rank and the usable part of it (capacity less the
planner's `HEADROOM`), labelled in GiB. Below, the step model's timeline of one optimizer step: each lane's ops
as the engine's recorded step replayed them with the plan's times (`StepGraph.spans`), and the device's idle time
in it, the part of the copies and the host step that is exposed (not overlapped with compute). A plan without
host work has no replayed graph: its closed-form micro-steps are drawn instead, and a plan without a predicted
step (no accelerator) draws the memory alone. The step model has no NVMe ops of its own: swap-file I/O is inside
the host step's duration (and stage 3's parameter reads inside the passes'), and the picture says so.

`plot_plan` returns what it drew (`PlanPicture`), read back from the figure's bars and lines, so that tests hold
the picture itself to the estimate.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from zero_offload.estimate.planner import HEADROOM, Plan
from zero_offload.estimate.step_graph import NAMES

__all__ = ["PlanPicture", "PLOT_FORMATS", "check_plot_path", "plan_picture", "plot_plan"]

# The file formats `--plot` writes (the suffix of its path), all written by matplotlib without extra packages.
PLOT_FORMATS = ("png", "pdf", "svg")
GIB = 2**30
# Each op kind's colour in the timeline, and the legend's names for the kinds `step_graph.NAMES` lacks.
KIND_COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "d2h": "#dd8452", "h2d": "#8172b3",
                "host_add": "#937860", "host_step": "#c44e52", "host_save": "#8c8c8c", "micro_step": "#4c72b0"}
EXTRA_NAMES = {"micro_step": "micro-step (closed form)", "device_step": "device optimizer step (ratio < 1)"}
EXPOSED_COLOUR = "#d62728"     # drawn hatched, so that it is not read as the host step's red


@dataclass
class PlanPicture:
    """What a plan's picture shows, in bytes and seconds (`plan_picture`: what to draw; `plot_plan`: what was
    drawn, read back from the figure).

    Attributes:
        memory: {tier: {kind: bytes per rank}}, stacked left to right in this order; the tiers are "device"
            (with an accelerator), "host" (without one also the compute's memory, as `MemoryEstimate.need` counts
            it) and "nvme" (where the plan writes swap files). Kinds of 0 bytes are left out.
        capacity: {tier: bytes per rank}: the device's memory, and host memory and NVMe over the plan's ranks.
        usable: {tier: bytes per rank}: capacity less `HEADROOM`, what the plan must stay under.
        lanes: {lane label: [(start s, end s, kind)]}: one step's ops as the step model replayed them
            (`StepGraph.spans`, seconds from the step's start), or the closed form's micro-steps (kind
            ``micro_step``) where no host work was replayed; empty without a predicted step.
        exposed: [(start s, end s)]: the device's idle time in the replayed step (host step and copies not hidden).
        serial: [(start s, end s, kind)]: work the step model adds after the replayed step (``device_step``: the
            device part's optimizer step of ``offload_optimizer.ratio`` < 1).
        step_s: seconds of the predicted step (0.0 without one).
        source: "replayed" (the engine's recorded step), "closed form" or "none".
        nvme_in_host_step: the host step's lane includes swap-file I/O (the plan's optimizer is on NVMe).
        nvme_in_passes: forward and backward include stage 3's parameter reads from NVMe (the longer of the two).
        gas: micro-steps per optimizer step; the replay draws the second as all ``gas - 1`` after the first.
    """
    memory: dict[str, dict[str, int]]
    capacity: dict[str, int]
    usable: dict[str, int]
    lanes: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)
    exposed: list[tuple[float, float]] = field(default_factory=list)
    serial: list[tuple[float, float, str]] = field(default_factory=list)
    step_s: float = 0.0
    source: str = "none"
    nvme_in_host_step: bool = False
    nvme_in_passes: bool = False
    gas: int = 1


def check_plot_path(path: str | Path, flag: str = "--plot") -> Path:
    """``path`` as a `Path` once it can be written: its suffix one of `PLOT_FORMATS` and its directory existing.

    Raises:
        ValueError: no or another suffix, or a directory that does not exist (the message names ``flag``).
    """
    p = Path(path)
    suffix = p.suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise ValueError(f"{flag} {path}: cannot write a {('.' + suffix) if suffix else 'suffix-less'} file; "
                         f"give a path ending in {', '.join('.' + f for f in PLOT_FORMATS)}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
    return p


def plan_picture(result: Plan) -> PlanPicture:
    """The numbers `plot_plan` draws for ``result``'s chosen row: its `MemoryEstimate` by tier and kind, the
    capacities the plan was made for, and its predicted step's lanes (see `PlanPicture`).

    Raises:
        ValueError: ``result`` has no plan (nothing fits).
    """
    chosen = result.chosen
    if chosen is None or chosen.estimate is None:
        raise ValueError("nothing fits: there is no plan to draw")
    est, cap, ranks = chosen.estimate, result.capacity, max(1, result.ranks)
    memory: dict[str, dict[str, int]] = {}
    capacity: dict[str, int] = {}
    if est.accelerator and cap["device"] is not None:
        memory["device"] = {k: v for k, v in est.device.items() if v}
        capacity["device"] = int(cap["device"])
        host = {k: v for k, v in est.host.items() if v}
    else:                      # no accelerator: the compute's memory is host memory too (`MemoryEstimate.need`)
        host = {}
        for side in (est.device, est.host):
            for k, v in side.items():
                if v:
                    host[k] = host.get(k, 0) + v
    memory["host"] = host
    capacity["host"] = int(cap["host"] // ranks)
    if any(est.nvme.values()):
        memory["nvme"] = {k: v for k, v in est.nvme.items() if v}
        capacity["nvme"] = int((cap["nvme"] or 0) // ranks)
    usable = {tier: int(c * (1 - HEADROOM)) for tier, c in capacity.items()}
    zero = (chosen.batch.raw if chosen.batch is not None else result.config or {}).get("zero_optimization", {})
    picture = PlanPicture(memory, capacity, usable,
                          nvme_in_host_step=(zero.get("offload_optimizer") or {}).get("device") == "nvme",
                          nvme_in_passes=(zero.get("offload_param") or {}).get("device") == "nvme")
    timing = chosen.batch.timing if chosen.batch is not None else None
    picture.gas = chosen.batch.gas if chosen.batch is not None else 1
    if timing is None:
        return picture
    graph = timing.graph
    if graph is not None:
        picture.lanes = {lane: list(spans) for lane, spans in graph.spans.items()}
        picture.step_s, picture.source = graph.step_s, "replayed"
        picture.exposed = idle_spans(picture.lanes.get("device compute", []), graph.step_s)
        if timing.step_s > graph.step_s:
            picture.serial = [(graph.step_s, timing.step_s, "device_step")]
    else:
        later = timing.later_micro_s if timing.later_micro_s is not None else timing.micro_s
        t, micro = 0.0, []
        for i in range(chosen.batch.gas):
            d = timing.micro_s if i == 0 else later
            micro.append((t, t + d, "micro_step"))
            t += d
        picture.lanes = {"device compute": micro}
        picture.step_s, picture.source = timing.step_s, "closed form"
    return picture


def idle_spans(busy: list[tuple[float, float, str]], step_s: float) -> list[tuple[float, float]]:
    """[(start s, end s)] of ``[0, step_s]`` that no span of ``busy`` covers (the device idle in a step)."""
    out, t = [], 0.0
    for start, end, _ in sorted(busy):
        if start > t:
            out.append((t, min(start, step_s)))
        t = max(t, end)
    if t < step_s:
        out.append((t, step_s))
    return [(a, b) for a, b in out if b > a]


def plot_plan(result: Plan, path: str | Path, title: str = "") -> PlanPicture:
    """Draw ``result``'s plan (module docstring) into ``path`` (a format of `PLOT_FORMATS`, by its suffix) with
    matplotlib's Agg canvas, and return what was drawn, read back from the figure's bars and lines: bytes per
    rank and seconds (`PlanPicture`).

    Raises:
        ValueError: nothing fits, or ``path``'s suffix or directory is wrong (`check_plot_path`).
        OSError: the file cannot be written.
    """
    path = check_plot_path(path)
    picture = plan_picture(result)
    from matplotlib.backends.backend_agg import FigureCanvasAgg     # imported here: only a plot needs it
    from matplotlib.figure import Figure

    tiers = list(picture.memory)
    rows = len(picture.lanes) + (1 if picture.source == "replayed" else 0)
    heights = [1.0] * len(tiers) + ([max(1.2, 0.4 * rows)] if picture.lanes else [])
    fig = Figure(figsize=(11, 1.5 * sum(heights) + 0.9), dpi=80, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    colours = kind_colours([k for tier in tiers for k in picture.memory[tier]])
    for i, tier in enumerate(tiers):
        draw_tier(fig.add_subplot(grid[i]), tier, picture, colours)
    if picture.lanes:
        draw_timeline(fig.add_subplot(grid[len(tiers)]), picture)
    untimed = "" if picture.lanes else " (no predicted step" + ("" if "device" in tiers else ": no accelerator") + ")"
    fig.suptitle((title or f"plan: {result.name}") + untimed, fontsize=11)
    fig.savefig(path)
    return read_back(fig, picture)


def read_back(fig, planned: PlanPicture) -> PlanPicture:
    """``planned`` with its bytes and seconds replaced by what ``fig``'s bars and lines show (each drawn with a
    ``gid`` naming what it is): memory bars back from GiB to bytes, timeline bars as (start s, end s)."""
    memory: dict[str, dict[str, int]] = {}
    lines: dict[str, dict[str, int]] = {"capacity": {}, "usable": {}}
    lanes: dict[str, list[tuple[float, float, str]]] = {}
    exposed: list[tuple[float, float]] = []
    serial: list[tuple[float, float, str]] = []
    for ax in fig.axes:
        for line in ax.lines:
            what, _, tier = (line.get_gid() or "").partition("|")
            if what in lines:
                lines[what][tier] = round(line.get_xdata()[0] * GIB)
                memory.setdefault(tier, {})
        for patch in ax.patches:
            what, *key = (patch.get_gid() or "").split("|")
            start, end = float(patch.get_x()), float(patch.get_x() + patch.get_width())
            if what == "memory":
                memory.setdefault(key[0], {})[key[1]] = round(patch.get_width() * GIB)
            elif what == "lane":
                lanes.setdefault(key[0], []).append((start, end, key[1]))
            elif what == "serial":
                serial.append((start, end, key[0]))
            elif what == "exposed":
                exposed.append((start, end))
    return dataclasses.replace(planned, memory=memory, capacity=lines["capacity"], usable=lines["usable"],
                               lanes=lanes, exposed=exposed, serial=serial)


def kind_colours(kinds: list[str]) -> dict[str, tuple]:
    """One colour per memory kind (a kind keeps its colour across tiers)."""
    from matplotlib import colormaps
    cmap = colormaps["tab20"]
    order = list(dict.fromkeys(kinds))
    return {k: cmap(i % cmap.N) for i, k in enumerate(order)}


def draw_tier(ax, tier: str, picture: PlanPicture, colours: dict) -> None:
    """One tier's stacked bar of bytes per kind in GiB, with its capacity and usable lines."""
    kinds, cap, usable = picture.memory[tier], picture.capacity[tier], picture.usable[tier]
    total = sum(kinds.values())
    right = max(total, cap) / GIB * 1.04 or 1.0
    left = 0.0
    for kind, nbytes in kinds.items():
        width = nbytes / GIB
        ax.barh(0, width, left=left, height=0.6, color=colours[kind], edgecolor="white", linewidth=0.5,
                label=f"{kind} {width:.2f}", gid=f"memory|{tier}|{kind}")
        if width > 0.09 * right:
            ax.text(left + width / 2, 0, kind, ha="center", va="center", fontsize=7, clip_on=True)
        left += width
    ax.axvline(cap / GIB, color="black", linewidth=1.5, gid=f"capacity|{tier}")
    ax.axvline(usable / GIB, color="black", linewidth=1, linestyle="--", gid=f"usable|{tier}")
    ax.text(cap / GIB, 0.42, f" capacity {cap / GIB:.1f}", ha="right", va="bottom", fontsize=7)
    ax.set_xlim(0, right)
    ax.set_ylim(-0.5, 0.75)
    ax.set_yticks([])
    ax.set_xlabel("GiB per rank", fontsize=8)
    ax.tick_params(labelsize=7)
    where = {"device": "device", "host": "host memory", "nvme": "NVMe"}[tier]
    ax.set_title(f"{where}: {total / GIB:.2f} GiB of {cap / GIB:.1f} GiB per rank "
                 f"(dashed: {1 - HEADROOM:.0%} usable)", fontsize=9, loc="left")
    if kinds:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=6.5, frameon=False,
                  ncol=2 if len(kinds) > 6 else 1, title="GiB", title_fontsize=7)
    else:
        ax.text(0.01, 0, "nothing", va="center", fontsize=8, transform=ax.get_yaxis_transform())


def draw_timeline(ax, picture: PlanPicture) -> None:
    """The step's lanes, one row each (top down), then the device's idle (exposed) row, in seconds."""
    labels = list(picture.lanes)
    seen: dict[str, object] = {}
    for row, lane in enumerate(labels):
        for start, end, kind in picture.lanes[lane]:
            name = NAMES.get(kind, EXTRA_NAMES.get(kind, kind))
            if kind == "host_step" and picture.nvme_in_host_step:
                name += " (with its NVMe reads and writes)"
            bar = ax.barh(row, end - start, left=start, height=0.7, color=KIND_COLOURS.get(kind, "#999999"),
                          gid=f"lane|{lane}|{kind}")
            seen.setdefault(name, bar)
    for start, end, kind in picture.serial:
        row = labels.index("device compute") if "device compute" in labels else 0
        bar = ax.barh(row, end - start, left=start, height=0.7, color="#cccccc", hatch="//", edgecolor="#555555",
                      gid=f"serial|{kind}")
        seen.setdefault(EXTRA_NAMES.get(kind, kind), bar)
    if picture.source == "replayed":
        row = len(labels)
        labels.append("device idle (exposed)")
        idle = sum(b - a for a, b in picture.exposed)
        for start, end in picture.exposed:
            bar = ax.barh(row, end - start, left=start, height=0.7, facecolor="white", hatch="xxx",
                          edgecolor=EXPOSED_COLOUR, linewidth=0, gid="exposed")
            seen.setdefault(f"exposed {idle:.3f} s ({idle / picture.step_s:.0%})", bar)
    shown = [lane + (" (with NVMe reads)" if lane == "device compute" and picture.nvme_in_passes else "")
             for lane in labels]
    ax.set_yticks(range(len(labels)), shown, fontsize=8)
    ax.invert_yaxis()
    end = max([picture.step_s] + [e for _, e, _ in picture.serial])
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("seconds from the step's start", fontsize=8)
    ax.tick_params(labelsize=7)
    what = {"replayed": "the engine's recorded step replayed with the plan's times",
            "closed form": "closed form: no host work to replay"}[picture.source]
    if picture.source == "replayed" and picture.gas > 2:
        what += f"; micro-steps 2-{picture.gas} drawn as one, as the model times them"
    ax.set_title(f"predicted step: {picture.step_s:.3f} s, one rank ({what})", fontsize=9, loc="left")
    ax.legend(list(seen.values()), list(seen), loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7,
              frameon=False)
    ax.grid(axis="x", alpha=0.3)
