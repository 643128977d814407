"""`python -m benchmarks.report` (BENCHMARKS.md's table of current figures), without running a benchmark: each
registry row's extractor turns a recorded result, shaped like its benchmark's real output, into the right figures;
``--write`` replaces only the rows it produced, between the markers, keeping every other byte of the document; every
row's command names a script that exists and whose argparse takes the flags given (read from its source); ``--list``
names every row."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.report_rows import BY_NAME, ROWS  # noqa: E402
from benchmarks.report_run import command_argv, cpu_model  # noqa: E402
from benchmarks.report_table import BEGIN, END, HEADER, RULE, format_row, replace_rows, row_name, table_names  # noqa
from benchmarks.report_types import Figures, RowError  # noqa: E402

TORCH, DS = "torch fused AdamW + 2 casts", "DeepSpeed CPUAdam + 2 casts"


def _convert_stdout() -> str:
    """bench_convert_memory.py's output lines, in its own formats (peak RSS, ratio, peak anon, ratio, seconds)."""
    runs = {"DeepSpeed ds_to_universal.py": (5352, 5277, 52.0), "zero-offload convert": (4089, 536, 25.8),
            "zero-offload convert --to dcp": (4212, 582, 24.4), "floor: import zero_offload": (224, 148, 3.3)}
    lines = ["GPT 24 layers x 1024, vocab 32768: 335.9M parameters, optimizer partition files 3844 MiB",
             f"{'converter':<40} {'peak RSS MiB':>12} {'x DS':>6} {'peak anon MiB':>13} {'x DS':>6} {'seconds':>8}"]
    lines += [f"{n:<40} {r:>12.0f} {r / 5352:>6.2f} {a:>13.0f} {a / 5277:>6.2f} {s:>8.1f}"
              for n, (r, a, s) in runs.items()]
    lines.append('{"params": 335900000, "state_mib": 3844.0, "peak_rss_mib": {}, "peak_anonymous_mib": '
                 '{"DeepSpeed ds_to_universal.py": 5277.4, "zero-offload convert": 536.2}}')
    return "\n".join(lines) + "\n"


def _ckpt(engine, model, params, save, load, mib, consolidate=None):
    r = {"engine": engine, "model": model, "parameters": params, "save_s": save, "load_s": load,
         "bytes": int(mib * 2**20), "checkpoint_dir": "/tmp/x"}
    if consolidate:
        keys = ("import_only_peak_mib", "consolidate_peak_mib", "seconds", "file_mib")
        r["consolidate"] = dict(zip(keys, consolidate))
    return r


def _engine(engine, ws, step_s, status="ok"):
    return {"engine": engine, "world_size": ws, "status": status, "step_s": step_s, "forward_s": 0.1}


TRL_STDOUT = "".join(
    f"round {r}: stage 2 + offload {a:.3f} s/step; stage 3 + offload {b:.3f} s/step (ratio {b / a:.2f}); "
    f"stage 3 generating module by module 0.700 s/step (ratio 1.60)\n"
    for r, (a, b) in enumerate([(0.389, 0.512), (0.444, 0.548), (0.445, 0.650), (0.455, 0.466), (0.517, 0.546)])
) + "median ratio stage 3 / stage 2: 1.23 (bound 1.5); module by module: 1.60\n"

# One recorded result per command (keyed by a row of it), shaped like the benchmark's real output.
RESULTS = {
    "adam-torch": {"params": 50_000_000, "rows": [
        {"path": "zero-offload fused", "gparams_per_s": 1.982}, {"path": TORCH, "gparams_per_s": 1.211},
        {"path": "zero-offload bf16 master, nearest", "gparams_per_s": 0.958}, {"path": DS, "gparams_per_s": 1.177}]},
    "zero2-1rank": {"meta": {}, "results": [_engine("ours", 1, 0.2663), _engine("deepspeed", 1, 0.3311),
                                            _engine("ours", 2, 0.6030), _engine("deepspeed", 2, 0.6766)]},
    "zero3-deepspeed": {"meta": {}, "results": [_engine("ours-stage2", 2, 0.5881), _engine("ours", 2, 0.6156),
                                                _engine("deepspeed", 2, 0.7687), _engine("fsdp2", 2, 0.7542),
                                                _engine("plain", 2, 0.4635)]},
    "hf-trainer": {"variants": {"plain": {"step_s_per_round": [0.41, 0.396, 0.39], "ratio": 1.0},
                                "ours-stage2-offload": {"step_s_per_round": [0.35, 0.344, 0.33], "ratio": 0.921}}},
    "stand-in-step": {"median": {"direct": {"step_s": 0.1936, "startup_s": 2.59},
                                 "stand-in": {"step_s": 0.1949, "startup_s": 2.55}},
                      "ratio_step": 1.0067, "ratio_startup": 0.9846},
    "ckpt-save": [_ckpt("ours", "tiny", 4.2e6, 0.17, 0.04, 48.6), _ckpt("deepspeed", "tiny", 4.2e6, 0.15, 0.05, 56.6),
                  _ckpt("ours", "gpt2", 124.4e6, 2.95, 1.93, 1424.2, (145.0, 294.0, 3.4, 475.0)),
                  _ckpt("deepspeed", "gpt2", 124.4e6, 3.39, 3.19, 1661.5)],
    "convert-memory": {"stdout": _convert_stdout()},
    "nvme-swapper": {"swapper": {"write": 0.91e9, "read": 0.82e9, "write_vs_deepspeed_paired": 1.09,
                                 "read_vs_deepspeed_paired": 1.05},
                     "deepspeed_aio": {"write": 0.84e9, "read": 0.95e9},
                     "host_step": {"step_s": [7.17, 7.15], "io_overlapped_bound_s": 8.13,
                                   "ratio_to_overlapped_bound": 0.8795}},
    "planner-warm": {"in process": {"median_s": {"first": 18.3, "later": 4.7}, "later_over_first": 0.2563,
                                    "same_plan": True},
                     "subprocess": {"median_s": {"first": 19.6, "later": 4.8}, "later_over_first": 0.2459,
                                    "same_plan": False}},
    "planner-choice": {
        "xs": {"planned": "stage 0", "planned_over_this_by_step": {"stage 0": 1.0, "stage 1": 0.99}, "ok": True},
        "l": {"planned": "stage 0", "planned_over_this_by_step": {"stage 0": 1.0, "stage 1": 1.02, "stage 2": 1.01},
              "ok": True}},
    "trl-grpo": {"stdout": TRL_STDOUT},
    "muon-step": {"host_side": {"muon_partition_native": {"params_per_s": 792e6},
                                "muon_partition_torch": {"params_per_s": 241e6}},
                  "two_ranks": {"engine_step_s": 1.112, "reference_step_s": 0.883, "ratio": 1.2593}},
    "host-bytes": {"mode": "rss", "runs": {"masters": {"breakdown_per_side": {"host": 8.0, "device": 5.96}},
                                           "masters-grads-on-device": {"breakdown_per_side": {"host": 6.1}}}},
}

EXPECTED = {
    "adam-torch": ("1.98 Gparam/s", f"{TORCH} 1.21 Gparam/s", "1.64x"),
    "adam-deepspeed": ("1.98 Gparam/s", f"{DS} 1.18 Gparam/s", "1.68x"),
    "adam-bf16-master": ("0.96 Gparam/s", f"{TORCH} 1.21 Gparam/s", "0.79x"),
    "zero2-1rank": ("266.3 ms/step", "DeepSpeed 331.1 ms/step", "0.80x"),
    "zero2-2ranks": ("603.0 ms/step", "DeepSpeed 676.6 ms/step", "0.89x"),
    "zero3-deepspeed": ("615.6 ms/step", "DeepSpeed stage 3 768.7 ms/step", "0.80x"),
    "zero3-fsdp2": ("615.6 ms/step", "FSDP2 754.2 ms/step", "0.82x"),
    "hf-trainer": ("0.344 s/step", "plain Trainer (torch AdamW) 0.396 s/step", "0.92x paired"),
    "stand-in-step": ("194.9 ms/step", "direct import 193.6 ms/step", "1.007x"),
    "stand-in-startup": ("2.55 s", "direct import 2.59 s", "0.985x"),
    "ckpt-save": ("2.95 s, 1424 MiB", "DeepSpeed 3.39 s, 1662 MiB", "0.87x"),
    "ckpt-load": ("1.93 s", "DeepSpeed 3.19 s", "0.61x"),
    "ckpt-consolidate": ("+149 MiB anon above import (294 peak)", "the fp32 model file 475 MiB", "0.31x"),
    "convert-memory": ("536 MiB anon", "ds_to_universal.py 5277 MiB anon", "0.10x"),
    "convert-time": ("25.8 s", "ds_to_universal.py 52.0 s", "0.50x"),
    "nvme-swapper": ("0.91 / 0.82 GB/s", "DeepSpeed aio 0.84 / 0.95 GB/s", "1.09 / 1.05x paired"),
    "nvme-host-step": ("7.15 s/step", "I/O bound 8.13 s", "0.88x"),
    "planner-warm": ("4.7 s warm", "first launch (cold) 18.3 s", "0.256x"),
    "planner-warm-subprocess": ("4.8 s warm", "first launch (cold) 19.6 s", "0.246x, NOT the same plan"),
    "planner-choice": ("planned stage 0 (2 sizes)", "fastest other: stage 1 at l", "1.02 paired by step"),
    "trl-grpo": ("0.546 s/step", "stage 2 0.445 s/step", "1.23x paired"),
    "muon-step": ("1.112 s", "DeepSpeed MuonWithAuxAdam 0.883 s", "1.26x"),
    "muon-partition": ("792M params/s", "torch ops 241M params/s", "3.29x"),
    "host-bytes": ("6.10 B/param", "partition on the host 8.00 B/param", "0.76x"),
}


def _result_for(row_name_: str):
    """The recorded result of the command that ``row_name_`` runs (rows sharing a command share one)."""
    command = BY_NAME[row_name_].command
    for name, result in RESULTS.items():
        if BY_NAME[name].command == command:
            return result
    raise AssertionError(f"no recorded result for {row_name_}'s command")


def _fake_runner(calls: list):
    def run(command, workdir, quick):
        calls.append(command)
        return next(r for n, r in RESULTS.items() if BY_NAME[n].command == command)
    return run


@pytest.mark.parametrize("name", [row.name for row in ROWS])
def test_each_row_extracts_its_figures_from_a_recorded_result(name):
    assert name in EXPECTED, f"row {name} has no recorded result and expected figures in this test"
    assert BY_NAME[name].extract(_result_for(name)) == Figures(*EXPECTED[name])


def test_a_missing_peer_or_a_failed_configuration_is_an_error_not_a_figure():
    adam = {"rows": [{"path": "zero-offload fused", "gparams_per_s": 2.0}, {"path": TORCH, "gparams_per_s": 1.0},
                     {"path": DS, "error": "ModuleNotFoundError: deepspeed", "bytes_per_param": 40}]}
    assert BY_NAME["adam-torch"].extract(adam).ratio == "2.00x"
    with pytest.raises(RowError, match="deepspeed"):
        BY_NAME["adam-deepspeed"].extract(adam)
    engine = {"results": [_engine("ours", 1, 0.3), _engine("deepspeed", 1, None, status="failed")]}
    with pytest.raises(RowError):
        BY_NAME["zero2-1rank"].extract(engine)
    with pytest.raises(RowError):
        BY_NAME["zero2-2ranks"].extract(engine)                 # not run at world size 2
    nvme = {**RESULTS["nvme-swapper"], "deepspeed_aio": {"error": "skipped (--no-deepspeed)"}}
    with pytest.raises(RowError, match="skipped"):
        BY_NAME["nvme-swapper"].extract(nvme)
    assert BY_NAME["nvme-host-step"].extract(nvme).ours == "7.15 s/step"     # the host step needs no peer
    skipped = {"runs": {"masters": {"skipped": "predicted 20 GiB"}, "masters-grads-on-device": {}}}
    with pytest.raises(RowError, match="predicted"):
        BY_NAME["host-bytes"].extract(skipped)
    only_ours = [r for r in RESULTS["ckpt-save"] if r["engine"] == "ours"]
    with pytest.raises(RowError):
        BY_NAME["ckpt-save"].extract(only_ours)
    with pytest.raises(RowError):
        BY_NAME["trl-grpo"].extract({"stdout": "Traceback (most recent call last):\n"})
    xs = {"xs": RESULTS["planner-choice"]["xs"]}         # every other config slower: the worst is still an other
    assert BY_NAME["planner-choice"].extract(xs).peer == "fastest other: stage 1 at xs"
    bad = {**RESULTS["planner-choice"], "m": {"planned": "stage 2", "planned_over_this_by_step": {"stage 0": 1.2},
                                              "ok": False}}
    assert BY_NAME["planner-choice"].extract(bad) == Figures(
        "planned stage 0 / stage 2 (3 sizes)", "fastest other: stage 0 at m", "1.20 paired by step, NOT ok")


def _doc(rows: list[str], newline: str = "\n") -> str:
    head = ["# Title ", "", "Prose with ünïcode and a `| pipe |` that is not a row.  ", BEGIN, HEADER, RULE]
    tail = [END, "", "| `adam-torch` | a table below the markers | 1 | 2 | 3 | `c` | m | d |", "no final newline"]
    return newline.join(head + rows + tail)


def test_write_replaces_only_the_produced_rows_between_the_markers(tmp_path):
    gpu = "| `gpu-h200-10b` | GPU | 3.78 s/step | step model 3.915 s (*prediction*) | 0.97x | `g` | H200 | 2026-11 |"
    kept = "| `main-job` | kept as measured | 6:46 | – | – | `zero-offload train` | EPYC | 2026-11-21 |"
    old = "| `adam-torch` | old | 1.00 Gparam/s | torch 1.00 Gparam/s | 1.00x | `old` | old machine | 2026-01-01 |"
    for newline in ("\n", "\r\n"):
        doc = tmp_path / "BENCHMARKS.md"
        text = _doc([gpu, old, kept], newline)
        doc.write_bytes(text.encode())
        calls = []
        status = report.main(["--only", "zero2-1rank,adam-torch", "--write", "--doc", str(doc)], _fake_runner(calls))
        assert status == 0 and len(calls) == 2
        new = doc.read_bytes().decode()
        head, tail = text.split(BEGIN)[0], text.split(END)[1]
        assert new.startswith(head + BEGIN) and new.endswith(END + tail)
        lines = new.split(newline)
        start = lines.index(BEGIN)
        inside = lines[start + 1:lines.index(END)]
        assert inside[:3] == [HEADER, RULE, gpu] and inside[-1] == kept
        assert [row_name(line) for line in inside[2:]] == ["gpu-h200-10b", "adam-torch", "zero2-1rank", "main-job"]
        adam, zero2 = inside[3], inside[4]
        assert "| 1.98 Gparam/s | torch fused AdamW + 2 casts 1.21 Gparam/s | 1.64x |" in adam
        assert "`DS_ACCELERATOR=cpu python -m zero_offload.bench.optimizer --params 50000000" in adam
        assert "| 266.3 ms/step | DeepSpeed 331.1 ms/step | 0.80x |" in zero2
        assert adam.count("|") == zero2.count("|") == 9
        assert all("\n" not in line and "\r" not in line for line in inside)   # each new row ends as the others do


def test_write_on_a_copy_of_benchmarks_md_changes_that_row_alone(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    original = (ROOT / "BENCHMARKS.md").read_bytes()
    doc.write_bytes(original)
    assert report.main(["--only", "muon-step", "--write", "--doc", str(doc)], _fake_runner([])) == 0
    before, after = original.decode().split("\n"), doc.read_bytes().decode().split("\n")
    assert len(before) == len(after)
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert len(changed) <= 1 and all(row_name(after[i]) == "muon-step" for i in changed)


def test_replace_rows_refuses_a_document_without_its_markers():
    for text in ("no markers\n", f"{BEGIN}\n{BEGIN}\n{END}\n", f"{END}\n{BEGIN}\n"):
        with pytest.raises(ValueError):
            replace_rows(text, {"adam-torch": "| `adam-torch` |"}, ["adam-torch"])


def test_write_of_quick_figures_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        report.main(["--quick", "--write", "--doc", str(tmp_path / "x.md")], _fake_runner([]))


def test_rows_sharing_a_command_run_it_once_and_a_failed_run_fails_only_its_rows():
    calls = []
    lines, failed = report.produce([BY_NAME[n] for n in ("adam-torch", "adam-deepspeed", "muon-step")],
                                   _fake_runner(calls), Path("/tmp"), False)
    assert len(calls) == 2 and set(lines) == {"adam-torch", "adam-deepspeed", "muon-step"} and not failed

    def broken(command, workdir, quick):
        if command == BY_NAME["adam-torch"].command:
            raise RuntimeError("exited with 1")
        return _fake_runner([])(command, workdir, quick)
    lines, failed = report.produce([BY_NAME[n] for n in ("adam-torch", "adam-deepspeed", "muon-step")], broken,
                                   Path("/tmp"), False)
    assert set(lines) == {"muon-step"} and set(failed) == {"adam-torch", "adam-deepspeed"}
    assert "exited with 1" in failed["adam-deepspeed"]


def _options(script: Path) -> dict[str, dict]:
    """The ``--options`` a script's argparse declares, read from its source: whether each takes no value (store_true
    or store_false), several (nargs + or *), and its literal choices."""
    options = {}
    for node in ast.walk(ast.parse(script.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        action = kw["action"].value if isinstance(kw.get("action"), ast.Constant) else None
        nargs = kw["nargs"].value if isinstance(kw.get("nargs"), ast.Constant) else None
        try:
            choices = ast.literal_eval(kw["choices"]) if "choices" in kw else None
        except ValueError:
            choices = None                       # a name: not checked here
        for arg in node.args:
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
                options[arg.value] = {"flag": action in ("store_true", "store_false"), "many": nargs in ("+", "*"),
                                      "choices": choices}
    return options


def _check_arguments(arguments: list[str], options: dict[str, dict]) -> None:
    """Raise AssertionError where argparse would refuse ``arguments``: an unknown option, a value missing or out of
    its choices, a stray value."""
    i = 0
    while i < len(arguments):
        option = arguments[i]
        assert option in options, f"unknown option {option!r}"
        spec, i = options[option], i + 1
        if spec["flag"]:
            continue
        values = []
        while i < len(arguments) and not arguments[i].startswith("--") and (spec["many"] or not values):
            values.append(arguments[i])
            i += 1
        assert values, f"{option} needs a value"
        assert spec["choices"] is None or all(v in spec["choices"] for v in values), f"{option} {values}"


def test_the_argument_check_fails_on_what_argparse_refuses():
    options = _options(ROOT / "benchmarks" / "bench_engine.py")
    _check_arguments(["--compare", "stage3", "--steps", "3", "--json", "x"], options)
    for bad in (["--bogus", "1"], ["--steps"], ["--steps", "1", "2"], ["--compare", "stage4"]):
        with pytest.raises(AssertionError):
            _check_arguments(bad, options)


@pytest.mark.parametrize("name", [row.name for row in ROWS])
def test_each_rows_command_names_an_existing_script_that_takes_its_flags(name):
    command = BY_NAME[name].command
    script = command.script()
    assert script.is_file(), script
    options = _options(script)
    json_args = [command.json_flag, "out.json"] if command.json_flag else []
    for quick in (False, True):
        argv = command_argv(command, None, quick)
        assert argv[0] == sys.executable
        _check_arguments(list(command.arguments()) + json_args + (list(command.quick) if quick else []), options)


def test_list_names_every_row_and_the_rows_it_keeps(capsys):
    assert report.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {row.name} " in out for row in ROWS)
    kept = [n for n in table_names((ROOT / "BENCHMARKS.md").read_text()) if n not in BY_NAME]
    assert kept and all(n in out.split("not regenerated")[1] for n in kept)
    assert "GPU rows (gpu-" in out


def test_benchmarks_md_table_holds_every_registry_row_once_and_marks_predictions():
    text = (ROOT / "BENCHMARKS.md").read_text()
    names = table_names(text)
    assert len(names) == len(set(names))
    assert [n for n in names if n in BY_NAME] == [row.name for row in ROWS]
    lines = [line for line in text.split(BEGIN)[1].split(END)[0].splitlines() if row_name(line)]
    assert all(line.count("|") - line.count("\\|") == 9 for line in lines)
    assert all("*Prediction*" in line for line in lines if row_name(line).startswith("pred-"))


def test_format_row_keeps_a_pipe_inside_its_cell():
    line = format_row("x", "a | b", Figures("1", "2", "3"), "cmd", "m", "d")
    assert row_name(line) == "x" and line.count("|") - line.count("\\|") == 9


def test_cpu_model_reads_the_model_and_the_widest_isa():
    info = "processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu sse avx2 avx512f\n\nprocessor\t: 1\n"
    assert cpu_model(info) == "AMD EPYC 9B14 (AVX-512)"
    assert cpu_model("model name : Xeon\nflags : sse avx2\n") == "Xeon (AVX2)"
    assert cpu_model("flags : neon\n") == "unknown CPU"
