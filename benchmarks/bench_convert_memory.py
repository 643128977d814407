"""Peak host memory of converting a DeepSpeed ZeRO checkpoint to DeepSpeed's universal layout: DeepSpeed's own
``ds_to_universal.py`` against ``zero-offload convert --to deepspeed-universal``, on the same checkpoint, in one run
(issue 30, item 3: "converts offline, streaming"); beside them ``convert --to dcp`` and ``--to zero-offload`` of the
same checkpoint, and the floor: a process that only imports zero_offload (torch and its libraries).

DeepSpeed (CPU accelerator, one gloo rank, ZeRO stage 2, fp32, torch's AdamW) trains one step of a GPT and saves;
each converter then runs in its own process tree, whose resident and anonymous memory (every process of the tree
summed: the DeepSpeed converter forks workers) is sampled every 50 ms; anonymous memory leaves out the pages of
memory-mapped checkpoint files (zero-offload reads DeepSpeed's rank files memory-mapped). Printed: the checkpoint's
optimizer state, each converter's peaks and the ratios. Needs DeepSpeed (`pip install --no-build-isolation
deepspeed`).

    python benchmarks/bench_convert_memory.py [--layers 8] [--width 768] [--vocab 32768]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

_TRAIN = r'''
import os, sys, torch
os.environ["DS_ACCELERATOR"] = "cpu"
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from zero_offload.presets import GPTConfig
from zero_offload.train.model import GPT
layers, width, vocab, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=layers, n_head=width // 64, n_embd=width))
config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x = torch.randint(0, vocab, (1, 65))
engine.backward(engine(x[:, :-1], x[:, 1:])[1])
engine.step()
engine.save_checkpoint(path, tag="global_step1")
print(sum(p.numel() for p in model.parameters()))
'''


def _anonymous_bytes(pid: int) -> int:
    """The process's anonymous memory (heap, tensors; not the pages of memory-mapped files), from smaps_rollup."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_memory(cmd: list[str], env: dict) -> tuple[float, float, float]:
    """(peak resident MiB of ``cmd``'s process tree, peak anonymous MiB, seconds), sampled every 50 ms. Resident
    memory counts the pages of memory-mapped files read (page cache, which the kernel drops under pressure);
    anonymous memory is what the converter itself holds."""
    start = time.perf_counter()
    proc = psutil.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rss = anon = 0
    while proc.poll() is None:
        try:
            tree = [p for p in (proc, *proc.children(recursive=True)) if p.is_running()]
            rss = max(rss, sum(p.memory_info().rss for p in tree))
            anon = max(anon, sum(_anonymous_bytes(p.pid) for p in tree))
        except (psutil.Error, OSError):
            pass
        time.sleep(0.05)
    if proc.returncode:
        raise RuntimeError(f"{cmd[:4]} failed: {proc.stderr.read().decode()[-2000:]}")
    return rss / 2**20, anon / 2**20, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        out = subprocess.run([sys.executable, "-c", _TRAIN, str(args.layers), str(args.width), str(args.vocab),
                              str(tmp / "ds")], env=env, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        params = int(out.stdout.strip().splitlines()[-1])
        state_mib = sum(f.stat().st_size for f in (tmp / "ds").rglob("*optim_states.pt")) / 2**20
        runs = {
            "DeepSpeed ds_to_universal.py": [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                             "--input_folder", str(tmp / "ds" / "global_step1"), "--output_folder",
                                             str(tmp / "uc-ds" / "global_step1"), "--inject_missing_state"],
            "zero-offload convert": [sys.executable, "-m", "zero_offload", "convert", str(tmp / "ds"),
                                     str(tmp / "uc-ours"), "--to", "deepspeed-universal"],
            "zero-offload convert --to dcp": [sys.executable, "-m", "zero_offload", "convert", str(tmp / "ds"),
                                              str(tmp / "dcp"), "--to", "dcp"],
            "zero-offload convert --to zero-offload": [sys.executable, "-m", "zero_offload", "convert",
                                                       str(tmp / "ds"), str(tmp / "zo"), "--to", "zero-offload"],
            "floor: import zero_offload": [sys.executable, "-c", "import zero_offload, time; time.sleep(1)"],
        }
        results = {}
        for name, cmd in runs.items():
            results[name] = peak_memory(cmd, env)
            for leftover in ("uc-ds", "uc-ours", "dcp", "zo"):
                shutil.rmtree(tmp / leftover, ignore_errors=True)
    base = results["DeepSpeed ds_to_universal.py"]
    print(f"GPT {args.layers} layers x {args.width}, vocab {args.vocab}: {params / 1e6:.1f}M parameters, "
          f"optimizer partition files {state_mib:.0f} MiB")
    print(f"{'converter':<40} {'peak RSS MiB':>12} {'x DS':>6} {'peak anon MiB':>13} {'x DS':>6} {'seconds':>8}")
    for name, (rss, uss, seconds) in results.items():
        print(f"{name:<40} {rss:>12.0f} {rss / base[0]:>6.2f} {uss:>13.0f} {uss / base[1]:>6.2f} {seconds:>8.1f}")
    print(json.dumps({"params": params, "state_mib": state_mib,
                      "peak_rss_mib": {k: v[0] for k, v in results.items()},
                      "peak_anonymous_mib": {k: v[1] for k, v in results.items()}}))


if __name__ == "__main__":
    main()
