"""benchmarks/gpu_validate.py runs end to end at tiny sizes on the CPU, so the GPU check cannot rot."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_validate_tiny_cpu_smoke(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_validate.py"), "--device", "cpu",
                           "--tiny", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_validate.json").read_text())
    assert set(report["sections"]) == {"cuda_tests", "sanitizer", "gpt2", "largest", "gpt2_10b"}
    assert all(s["ok"] for s in report["sections"].values())
    runs = report["sections"]["gpt2"]["runs"]
    assert set(runs) == {"plain-adamw", "stage2-offload", "stage2-offload-dpu", "stage3-offload-both",
                         "stage3-offload-both-dpu"}
    assert all(r["tokens_per_s"] > 0 for r in runs.values())
    assert all(r["estimate_device_bytes"] > 0 for k, r in runs.items() if k != "plain-adamw")
    big = report["sections"]["gpt2_10b"]
    assert big["plan"]["fits"] and big["plan"]["trained"] == "plan" and big["tokens_per_s"] > 0
    assert big["plan"]["zero_optimization"]["stage"] in (0, 1, 2, 3)
    assert "(c) gpt2" in (tmp_path / "gpu_validate.md").read_text()
