"""benchmarks/gpu_validate.py runs end to end at tiny sizes on the CPU, so the GPU check cannot rot; and it
builds the native libraries itself when a checkout lacks them (issue 20, section 1: a GPU machine with no
network), which is exercised here on a copy of the repository in a temporary directory."""
import ctypes
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path


from zero_offload.native import LIBRARIES, missing_libraries, native_disabled, shared_library

ROOT = Path(__file__).resolve().parent.parent


def _gpu_validate(root: Path = ROOT):
    spec = importlib.util.spec_from_file_location("gpu_validate", root / "benchmarks" / "gpu_validate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checkout_without_libraries(dest: Path) -> Path:
    """A copy of this repository (what setup.py and the smoke run need) without any built library."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("src", "benchmarks", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__",
                                                                               "*.egg-info"))
    assert missing_libraries(dest / "src" / "zero_offload") == list(LIBRARIES)
    return dest


def test_gpu_validate_tiny_cpu_smoke(tmp_path):
    """The smoke run, from a checkout that lacks the native libraries: the run builds them first (issue 20)."""
    root = _checkout_without_libraries(tmp_path / "checkout")
    out = tmp_path / "out"
    sections = ("calibrate,cuda_tests,sanitizer,gpt2,gpt2_xl,gpt2_compiled,gpt2_10b,gpt2_10b_dpu,largest,"
                "largest_planned,two_gpus,llama_trainer,long_seq")
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_validate.py"), "--device", "cpu",
                           "--tiny", "--out", str(out), "--sections", sections], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu_validate.json").read_text())
    assert set(report["sections"]) == set(sections.split(","))
    assert all(s["ok"] for s in report["sections"].values())
    runs = report["sections"]["gpt2"]["runs"]
    engine_runs = {f"{name}{suffix}" for name in ("stage2-offload", "stage3-offload-both")
                   for suffix in ("", "-dpu", "-super", "-super-noclip")}
    engine_runs |= {f"stage2-offload{suffix}" for suffix in ("-ratio0.5", "-ratio0.5-super")}   # issue 28, item 2
    assert set(runs) == {"plain-adamw", *engine_runs}
    assert set(report["sections"]["gpt2_xl"]["runs"]) == {"plain-adamw", *(r for r in engine_runs if "stage2" in r)}
    for key in ("stage2-offload-super-noclip", "stage3-offload-both-super-noclip"):   # issue 28: no clipping, kept
        assert runs[key]["timings"]["host_step_kept"] == 1.0 and runs[key]["speculative_state_bytes"] > 0
    assert all(r["tokens_per_s"] > 0 for r in runs.values())
    # Issue 20, section 6: every run reports host syncs (0 on the CPU: the count path ran) and the copy overlap
    # (None: no copies on the CPU); engine runs the native kernel's state and engine.timings.
    assert all(r["host_syncs_per_step"] == 0 and r["copy_overlap"] is None for r in runs.values())
    for key, r in runs.items():
        if key != "plain-adamw":
            assert r["estimate_device_bytes"] > 0 and r["native_kernel"] == (not native_disabled())
            t = r["timings"]
            assert t["forward_s"] > 0 and t["forward_s"] + t["backward_s"] + t["optimizer_s"] <= t["step_s"] + 1e-6
    largest = report["sections"]["largest"]
    assert [a["layers"] for a in largest["attempts"]] == [1, 2, 4] and largest["largest"]["layers"] == 4
    for name, dpu in (("gpt2_10b", False), ("gpt2_10b_dpu", True)):
        big = report["sections"][name]
        assert big["config"]["zero_optimization"]["offload_optimizer"]["delayed_param_update"] is dpu
        assert big["tokens_per_s"] > 0 and big["predicted"]["step_s"] > 0
        assert len(big["losses_all_steps"]) == 2 + 2 + 1 + 2     # warm-up, timed, split, profiled: every loss
    # issue 27, items 6 and 8: the calibration file, and the host-step figures of every engine run
    calibration = json.loads((out / "calibration.json").read_text())
    constants = calibration["constants"]
    assert constants["host_adam_params_per_s"] > 0 and constants["h2d_bytes_per_s"] is None
    assert all(r["timings"]["host_step_threads"] >= 1 for k, r in runs.items() if k != "plain-adamw")
    assert report["sections"]["two_gpus"]["skipped"].startswith("needs 2 GPUs")
    llama = report["sections"]["llama_trainer"]          # issue 41, item 5: the Trainer with the plan's config
    assert llama["measured"]["tokens_per_s"] > 0 and len(llama["measured"]["losses"]) == 2
    assert llama["estimate"]["device"]["activations"] > 0 and llama["estimate"]["device_bytes"] > 0
    assert llama["config"]["train_micro_batch_size_per_gpu"] == llama["micro_batch"] == 2 and llama["mfu"] > 0
    assert set(llama["targets"]) == {"mfu_at_least_0.45", "device_memory_within_5pct"}
    long_seq = report["sections"]["long_seq"]          # issue 58, item 5: the planner's longest, one step, tiled
    assert long_seq["seq_len"] >= 1024 and long_seq["tiles"]["loss"] >= 1 and long_seq["estimate"]["device_bytes"] > 0
    assert long_seq["tiles"]["norms"] >= 1 and long_seq["longest"] >= long_seq["seq_len"]
    compiled = report["sections"]["gpt2_compiled"]["runs"]          # issue 29, item 5
    assert set(compiled) == {"plain-adamw", "plain-adamw-compiled", "stage2-offload-dpu-compiled",
                             "stage3-offload-both-compiled"} and all(r["tokens_per_s"] > 0 for r in compiled.values())
    md = (out / "gpu_validate.md").read_text()
    assert "(c) gpt2" in md and "gpt2, compiled (aot_eager)" in md and "| super_offload run |" in md
    # Issue 20: the missing libraries built by the run, and native_available() of both in its output.
    native, enabled = report["native"], not native_disabled()
    assert native["available"] == {"fused_adam": enabled, "aio": enabled}, native
    assert f"native_available: {native['available']}" in proc.stdout
    assert f"native_available(): fused_adam {enabled}, aio {enabled}" in md
    assert native["build"]["missing"] == ["fused_adam", "aio"] and native["build"]["built"] == enabled
    if enabled:
        assert "building them with `setup.py build_ext --inplace`" in proc.stdout and "(built by this run)" in md
        package = root / "src" / "zero_offload"
        for name, symbol in (("fused_adam", "zo_adam_step"), ("aio", "zo_aio_open")):
            path = shared_library(package / LIBRARIES[name][0], LIBRARIES[name][1])
            assert path is not None and hasattr(ctypes.CDLL(str(path)), symbol)
        again = _gpu_validate(root).ensure_native(root)          # nothing missing now: no second build
        assert not again["built"] and again["missing"] == []


def test_gpu_validate_records_a_failed_build(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ZERO_OFFLOAD_NO_NATIVE", raising=False)
    root = _checkout_without_libraries(tmp_path)
    (root / "setup.py").write_text("raise SystemExit('no C compiler here')\n")
    result = _gpu_validate().ensure_native(root)
    assert result["built"] and result["returncode"] != 0
    assert result["still_missing"] == ["fused_adam", "aio"] and "no C compiler here" in "\n".join(result["log"])
    assert "running on the fallbacks" in capsys.readouterr().out


def test_gpu_validate_does_not_build_when_native_is_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_OFFLOAD_NO_NATIVE", "1")
    root = _checkout_without_libraries(tmp_path)
    result = _gpu_validate().ensure_native(root)
    assert not result["built"] and result["still_missing"] == ["fused_adam", "aio"]
    assert missing_libraries(root / "src" / "zero_offload") == ["fused_adam", "aio"]
