"""Pictures (issue 59): `zero-offload estimate --plot` draws the plan the table prints -- the memory model's bytes
per kind on each tier against its capacity, and the step model's replayed timeline -- and `zero-offload train`
draws the measured step phases of metrics.jsonl. What each plot returns is read back from the figure's bars, so
these tests hold the picture itself, not a copy of its input, to the estimate."""
import contextlib
import io
import json
import re

import pytest

from zero_offload.cli import main
from zero_offload.estimate import plot
from zero_offload.estimate.planner import HEADROOM, fmt_bytes
from zero_offload.train import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Micro-batch 1, accumulation 1 and checkpointing on keep the planner's search short.
CASES = {
    # stage 2 does not fit a 1.6 GB device: ZeRO-Offload, the optimizer in host memory
    "offload": ["--model", "gpt2", "--gpus", "1", "--gpu-mem", "1.6GB", "--host-mem", "64GB", "--micro-batch", "1",
                "--grad-accum", "1", "--activation-checkpointing", "on"],
    # 8 GB of host memory is too little for any offload to it: stage 3 with states and parameters on NVMe
    "nvme": ["--model", "gpt2-xl", "--gpus", "1", "--gpu-mem", "4GB", "--host-mem", "8GB", "--nvme", "100GB",
             "--micro-batch", "1", "--grad-accum", "1", "--activation-checkpointing", "on"],
}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """{case: (exit code, png path, stdout, the Plan the command printed, what the plot returned)}: each command run
    once through the CLI, `plot_plan` wrapped to see its argument and its answer."""
    out = {}
    real = plot.plot_plan
    for name, argv in CASES.items():
        path = tmp_path_factory.mktemp(name) / "plan.png"
        seen = []

        def spy(result, p, title=""):
            seen.append((result, real(result, p, title)))
            return seen[-1][1]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plot, "plot_plan", spy)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = main(["estimate", "--no-deepspeed", *argv, "--plot", str(path)])
        assert len(seen) == 1, name
        out[name] = (rc, path, buf.getvalue(), *seen[0])
    return out


@pytest.mark.parametrize("case", CASES)
def test_the_png_is_written(drawn, case):
    rc, path, stdout, _, _ = drawn[case]
    data = path.read_bytes()
    assert rc == 0 and data[:8] == PNG_SIGNATURE and 20_000 < len(data) < 150_000
    assert f"wrote {path}" in stdout


@pytest.mark.parametrize("case,name,tiers", [
    ("offload", "stage 2 + offload opt", ["device", "host"]),
    ("nvme", "stage 3 + nvme opt+param", ["device", "host", "nvme"]),
])
def test_the_bytes_drawn_are_the_printed_plans(drawn, case, name, tiers):
    """Each kind's bar is the memory model's bytes for that kind on that tier (a bar of another kind's bytes, or a
    kind on the wrong tier, fails), each tier's sum is the table's figure, and each line the capacity per rank."""
    _, _, stdout, result, picture = drawn[case]
    assert result.name.startswith(name) and f"plan: {result.name}" in stdout
    est = result.chosen.estimate
    assert list(picture.memory) == tiers
    for tier in tiers:
        assert picture.memory[tier] == {k: v for k, v in getattr(est, tier).items() if v}, tier
    need = est.need()
    printed = re.search(r"memory: per rank (.*)", stdout).group(1)
    assert printed.startswith(f"{fmt_bytes(sum(picture.memory['device'].values()))} device, "
                              f"{fmt_bytes(sum(picture.memory['host'].values()))} host")
    assert {tier: sum(kinds.values()) for tier, kinds in picture.memory.items()} == \
        {tier: need[tier] for tier in tiers}
    per_rank = {"device": result.capacity["device"], "host": result.capacity["host"] // result.ranks,
                "nvme": (result.capacity["nvme"] or 0) // result.ranks}
    assert picture.capacity == {tier: per_rank[tier] for tier in tiers}
    assert picture.usable == {tier: int(per_rank[tier] * (1 - HEADROOM)) for tier in tiers}


@pytest.mark.parametrize("case", CASES)
def test_the_timeline_drawn_is_the_step_models(drawn, case):
    """Every lane's bars are the replayed step's ops (`StepGraph.spans`) and add up to the lane's busy time; the
    exposed bars are the device's idle time in the step; the step is the one the table prints."""
    _, _, stdout, result, picture = drawn[case]
    graph = result.batch.timing.graph
    assert graph is not None and picture.source == "replayed"
    assert list(picture.lanes) == list(graph.spans) == list(graph.bars)
    for lane, spans in graph.spans.items():
        got = picture.lanes[lane]
        assert [k for *_, k in got] == [k for *_, k in spans], lane
        assert [s for s, _, _ in got] == pytest.approx([s for s, _, _ in spans], abs=1e-12), lane
        assert [e for _, e, _ in got] == pytest.approx([e for _, e, _ in spans], abs=1e-12), lane
        assert sum(e - s for s, e, _ in got) == pytest.approx(graph.busy[lane], rel=1e-9), lane
    assert sum(e - s for s, e in picture.exposed) == pytest.approx(graph.idle_s, rel=1e-6, abs=1e-12)
    assert picture.step_s == graph.step_s
    assert f"predicted timeline of one step ({graph.step_s:.3f} s" in stdout
    assert {"device compute", "copies down"} <= set(picture.lanes)
    if case == "nvme":     # the host step (its swap I/O inside it) on the training thread, most of it exposed
        assert picture.nvme_in_host_step and picture.nvme_in_passes
        assert "host_step" in {k for spans in picture.lanes.values() for *_, k in spans}
        assert graph.idle_share > 0.5


def test_idle_spans_are_the_gaps_in_compute():
    busy = [(0.0, 1.0, "forward"), (1.5, 2.0, "backward"), (2.0, 2.5, "backward")]
    assert plot.idle_spans(busy, 3.0) == [(1.0, 1.5), (2.5, 3.0)]
    assert plot.idle_spans([], 2.0) == [(0.0, 2.0)]


@pytest.mark.parametrize("target,fault", [
    ("missing-dir/plan.png", "the directory"),
    ("plan.jpg", "cannot write a .jpg file"),
    ("plan", "suffix-less"),
])
def test_a_bad_plot_path_is_refused_by_name_before_planning(tmp_path, capsys, monkeypatch, target, fault):
    monkeypatch.setattr("zero_offload.estimate.table.plan_from_args",
                        lambda ns: pytest.fail("planned before checking --plot"))
    rc = main(["estimate", "--no-deepspeed", "--model", "tiny", "--plot", str(tmp_path / target)])
    err = capsys.readouterr().err
    assert rc == 2 and "--plot" in err and fault in err
    assert not list(tmp_path.iterdir())


def test_nothing_fits_writes_no_plot(tmp_path, capsys):
    target = tmp_path / "plan.png"
    rc = main(["estimate", "--no-deepspeed", "--model", "gpt2-10b", "--gpu-mem", "0", "--host-mem", "1GB",
               "--plot", str(target)])
    assert rc == 1 and not target.exists() and "nothing fits" in capsys.readouterr().out


def _metrics(path, device=False):
    """A small metrics.jsonl as `zero-offload train` writes it: evaluations, and three timed steps."""
    lines = [{"step": 0, "val_loss": 5.0}]
    for step, (f, b, o, e, total) in enumerate([(0.2, 0.5, 0.1, 0.06, 0.85), (0.25, 0.6, 0.12, 0.1, 1.0),
                                                 (0.2, 0.55, 0.1, 0.0, 0.9)], start=1):
        rec = {"step": step, "loss": 5.0 - step, "forward_s": f, "backward_s": b, "optimizer_s": o,
               "exposed_host_step_s": e, "step_s": total, "host_step_s": 0.3}
        if device:
            rec.update({"device_forward_s": f / 2, "device_backward_s": b / 2, "device_optimizer_s": o / 2,
                        "device_exposed_host_step_s": e / 2, "device_step_s": total / 2})
        lines.append(rec)
    lines.append({"step": 3, "val_loss": 2.5})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


@pytest.mark.parametrize("device", [False, True])
def test_train_draws_the_measured_phases(tmp_path, device):
    """The bars are each step's phases: forward, backward, the optimizer less its exposed host step, the exposed
    host step, and what step_s holds beyond them (a bar of the whole optimizer phase stacked on the exposed host
    step would count it twice and fail)."""
    _metrics(tmp_path / "metrics.jsonl", device)
    png = tmp_path / "timeline.png"
    times = report.plot_step_times(tmp_path / "metrics.jsonl", png)
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 10_000
    assert times.steps == [1, 2, 3] and times.median_step == 3 and times.host_step == [0.3] * 3
    expect = {"forward": [0.2, 0.25, 0.2], "backward": [0.5, 0.6, 0.55],
              "optimizer, less the host step": [0.04, 0.02, 0.1], "exposed host step": [0.06, 0.1, 0.0],
              "other": [0.05, 0.03, 0.05]}
    assert list(times.wall) == list(report.PHASES)
    for phase, values in expect.items():
        assert times.wall[phase] == pytest.approx(values, abs=1e-9), phase
        if device:
            assert times.device[phase] == pytest.approx([v / 2 for v in values], abs=1e-9), phase
    assert times.device == {} or device
    for i, total in enumerate([0.85, 1.0, 0.9]):
        assert sum(times.wall[p][i] for p in report.PHASES) == pytest.approx(total)


def test_train_without_timings_writes_no_timeline(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val_loss": 5.0}\n{"step": 1, "loss": 4.0}\n')
    assert report.plot_step_times(tmp_path / "metrics.jsonl", tmp_path / "timeline.png") is None
    assert not (tmp_path / "timeline.png").exists()
