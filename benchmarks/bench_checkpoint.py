"""Checkpoint save/load time and bytes written: zero-offload beside DeepSpeed, same model and config.

    python benchmarks/bench_checkpoint.py --models tiny,gpt2 [--repeats 3] [--json out.json]

Each engine runs in its own spawned process (one gloo rank, DS_ACCELERATOR=cpu for DeepSpeed): build the
GPT preset, take one ZeRO-2 + CPU-offload bf16 step so optimizer states exist, then time
``save_checkpoint`` and ``load_checkpoint`` (median of --repeats) and count the bytes of the saved tag.
Also measures the peak resident memory of ``zero-offload consolidate`` on our checkpoint against the
model's fp32 size and its largest parameter.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _worker(rank: int, engine_name: str, model_name: str, repeats: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if engine_name == "deepspeed":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch.distributed as dist
    from zero_offload.train.model import GPT, preset

    torch.manual_seed(0)
    model = GPT(preset(model_name))
    params = sum(p.numel() for p in model.parameters())
    if engine_name == "ours":
        import zero_offload
        engine = zero_offload.initialize(model, CONFIG)
    else:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    x = torch.randint(0, model.config.vocab_size, (1, 64))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    root = Path(tempfile.mkdtemp(prefix=f"ckpt_{engine_name}_"))
    saves, loads = [], []
    for i in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(str(root), tag=f"t{i}")
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.load_checkpoint(str(root), tag=f"t{i}")
        loads.append(time.perf_counter() - t0)
    result = {"engine": engine_name, "model": model_name, "parameters": params,
              "save_s": statistics.median(saves), "load_s": statistics.median(loads),
              "bytes": _dir_bytes(root / "t0"), "checkpoint_dir": str(root)}
    Path(out).write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def run(engine_name: str, model_name: str, repeats: int) -> dict:
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        mp.start_processes(_worker, args=(engine_name, model_name, repeats, _port(), out), nprocs=1,
                           start_method="spawn")
        return json.loads(Path(out).read_text())
    except Exception as e:  # noqa: BLE001 - a failed peer is reported, the run goes on
        return {"engine": engine_name, "model": model_name, "error": f"{type(e).__name__}: {str(e)[-300:]}"}
    finally:
        os.unlink(out)


def consolidate_peak(checkpoint_dir: str) -> dict:
    """Peak anonymous memory (MiB) of a child running `zero-offload consolidate`, beside one that only
    imports it."""
    # Anonymous memory only: the shards are read through mmap, and their page-cache pages (reclaimable,
    # shared) would otherwise count in RSS. A thread samples RssAnon while the work runs.
    sampler = ("import threading, time\n"
               "peak = [0]; done = threading.Event()\n"
               "def anon():\n"
               "    for line in open('/proc/self/status'):\n"
               "        if line.startswith('RssAnon:'): return int(line.split()[1])\n"
               "def watch():\n"
               "    while not done.is_set(): peak[0] = max(peak[0], anon()); time.sleep(0.002)\n"
               "t = threading.Thread(target=watch); t.start()\n")
    def peak(code: str) -> float:
        code = sampler + code + "\ndone.set(); t.join(); print(max(peak[0], anon()))"
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        return int(out.split()[-1]) / 2**10
    out = os.path.join(checkpoint_dir, "model.safetensors")
    base = peak("import zero_offload.checkpoint.consolidate")
    t0 = time.perf_counter()
    full = peak(f"import zero_offload.checkpoint.consolidate\nfrom zero_offload.cli import main\n"
                f"main(['consolidate', {checkpoint_dir!r}, '--tag', 't0', '--out', {out!r}])")
    return {"import_only_peak_mib": base, "consolidate_peak_mib": full, "seconds": time.perf_counter() - t0,
            "file_mib": os.path.getsize(out) / 2**20}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,gpt2")
    p.add_argument("--engines", default="ours,deepspeed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results = []
    for model_name in args.models.split(","):
        for engine_name in args.engines.split(","):
            if engine_name == "deepspeed":
                try:
                    import deepspeed  # noqa: F401
                except ImportError:
                    continue
            r = run(engine_name, model_name, args.repeats)
            if engine_name == "ours" and "error" not in r:
                r["consolidate"] = consolidate_peak(r["checkpoint_dir"])
            results.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'model':8} {'engine':10} {'params':>8} {'save s':>8} {'load s':>8} {'MiB':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['model']:8} {r['engine']:10} FAILED {r['error']}")
            continue
        print(f"{r['model']:8} {r['engine']:10} {r['parameters'] / 1e6:7.1f}M {r['save_s']:8.2f} "
              f"{r['load_s']:8.2f} {r['bytes'] / 2**20:8.1f}")
    for r in results:
        shutil.rmtree(r.get("checkpoint_dir", "/nonexistent"), ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
