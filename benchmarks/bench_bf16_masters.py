"""bf16 master weights (issue 42): validation loss of the main job, and host bytes per parameter at ~1B.

Mode 1 (default), validation loss. Runs the main job, ``python -m zero_offload train`` on its built-in corpus
(the Python standard library's source, BPE tokenizer), three times in fresh processes with the same preset,
steps, micro-batch, sequence length, data order and seed, differing only in the bf16 keys:

    fp32-masters   bf16.enabled (bf16 parameters, fp32 master weights and moments)
    bf16-nearest   + bf16_master_weights_and_grads, bf16_optimizer_states, master_weights_rounding "nearest"
    bf16-stochastic  the same with master_weights_rounding "stochastic"

All three are ZeRO stage 2 with ``offload_optimizer.device`` "cpu": configs/tiny_cpu.json with the micro-batch
set by ``--micro-batch``, the main job's default schedule for ``--steps`` (linear warm-up, cosine to 0.1x, as
`zero_offload.train.loop.default_config` sizes it) and the variant's ``bf16`` section. The runs share one token
cache (``OUT/data_cache``). Prints and writes (``--json``) each run's final validation loss, its validation-loss
curve (step, val_loss) and its wall time. The defaults (100 steps of 4 x 64 tokens, against tiny_cpu.json's
16 x the preset's 128) keep one bf16 run under ~9 minutes on 2 AVX2 cores, where a bf16 step of the tiny model
costs ~7x an fp32 one (torch's CPU bf16 matmul without AVX-512); on a GPU, raise them.

Mode 2 (``--rss``), host memory per parameter. For each variant, in its own subprocess: a GPT-2-shaped model
(``--n-layer`` x ``--n-embd``, vocabulary 50304, context ``--rss-seq-len``) is built directly in bf16
(``torch.set_default_dtype`` around construction: no fp32 copy), wrapped by ``zero_offload.initialize`` at stage 2
with the optimizer offloaded to the CPU and bf16 on, and trained for 2 steps on random tokens (micro-batch 1;
default 8 tokens: activations are negligible, and torch's bf16 matmul on a CPU without AVX-512 runs at ~0.2 GFLOP/s
for some layouts, so a 1B step costs ~1 minute per 8 tokens).
Variants: ``moments`` (bf16_optimizer_states only: fp32 masters), ``masters`` (bf16_master_weights_and_grads
and bf16_optimizer_states) and ``masters-grads-on-device`` (the same with ``offload_optimizer.gradients_on_device``:
the gradient partition kept on the device). Reported: resident memory (VmRSS) after imports, after the model is
built, after ``initialize`` and after each step; the peak (``ru_maxrss``); ``engine.memory_breakdown()`` by kind and
side; and these per parameter. Without an accelerator the "device" kinds (16-bit parameters, stage-2 buckets) are host
memory too, so RSS counts them; the "host" kinds are what the issue's host bytes/param counts, and RSS less
imports less the device kinds' bytes is its measured counterpart. Before each run
the child compares `zero_offload.estimate.estimate_memory`'s prediction with the memory available now and stops
rather than start a run that would not fit within ``--max-gib``.

    python benchmarks/bench_bf16_masters.py --steps 100 --micro-batch 4 --seq-len 64 --eval-every 25 \
        --json runs/bench_bf16_masters/val.json
    python benchmarks/bench_bf16_masters.py --rss --n-layer 18 --n-embd 2048 --json runs/bench_bf16_masters/rss.json
    python benchmarks/bench_bf16_masters.py --rss --variants masters --n-layer 8     # one variant, ~0.5B
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VAL_VARIANTS = {
    "fp32-masters": {"enabled": True},
    "bf16-nearest": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True,
                     "master_weights_rounding": "nearest"},
    "bf16-stochastic": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True,
                        "master_weights_rounding": "stochastic"},
}
RSS_VARIANTS = {
    "moments": {"enabled": True, "bf16_optimizer_states": True},
    "masters": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "masters-grads-on-device": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
}
# Variants that also keep the gradient partition on the device (``offload_optimizer.gradients_on_device``).
GRADS_ON_DEVICE = {"masters-grads-on-device"}
GiB = 2 ** 30


def machine() -> dict:
    """CPU model, cores, torch version, the commit (and whether the work tree differs from it), the date."""
    import torch
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "src")),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


# ---------------------------------------------------------------------------------------------------------------
# Mode 1: validation loss of the main job


def val_config(bf16: dict, steps: int, micro_batch: int) -> dict:
    """configs/tiny_cpu.json (stage 2, optimizer offloaded to the CPU) + the main job's default schedule + bf16."""
    import torch

    from zero_offload.train.loop import default_config
    cfg = json.loads((ROOT / "configs" / "tiny_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["scheduler"] = default_config(steps, torch.device("cpu"))["scheduler"]
    cfg["bf16"] = dict(bf16)
    return cfg


def run_val(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_cache").mkdir(exist_ok=True)
    results = {}
    for name in args.variants or list(VAL_VARIANTS):
        run_dir = out / name
        if run_dir.exists():          # a fresh run: no checkpoint or metrics of an earlier one
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        (run_dir / "data_cache").symlink_to((out / "data_cache").resolve(), target_is_directory=True)
        cfg_path = out / f"{name}.json"
        cfg_path.write_text(json.dumps(val_config(VAL_VARIANTS[name], args.steps, args.micro_batch), indent=1))
        cmd = [sys.executable, "-m", "zero_offload", "train", "--model", args.model, "--config", str(cfg_path),
               "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--eval-every", str(args.eval_every),
               "--save-every", str(args.steps), "--seed", str(args.seed), "--out", str(run_dir)]
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        with open(run_dir / "train.log", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
        seconds = time.perf_counter() - t0
        if rc != 0:
            tail = (run_dir / "train.log").read_text()[-2000:]
            raise SystemExit(f"[{name}] exited with {rc} after {seconds:.0f} s:\n{tail}")
        curve, train_loss = [], []
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "val_loss" in rec:
                curve.append([rec["step"], rec["val_loss"]])
            elif "loss" in rec:
                train_loss.append(rec["loss"])
        tail = train_loss[-min(10, len(train_loss)):]
        results[name] = {"bf16": VAL_VARIANTS[name], "final_val_loss": curve[-1][1], "val_curve": curve,
                         "train_loss_last10_mean": sum(tail) / len(tail), "seconds": round(seconds, 1)}
        print(f"[{name}] final val loss {curve[-1][1]:.4f} in {seconds:.0f} s; curve "
              + ", ".join(f"{s}: {v:.4f}" for s, v in curve), flush=True)
    base = results.get("fp32-masters", {}).get("final_val_loss")
    print(f"\n{'variant':<17} {'final val loss':>14} {'vs fp32 masters':>16} {'seconds':>8}")
    for name, r in results.items():
        delta = f"{r['final_val_loss'] - base:+.4f}" if base is not None else "-"
        print(f"{name:<17} {r['final_val_loss']:>14.4f} {delta:>16} {r['seconds']:>8.0f}")
    return {"mode": "val", "model": args.model, "steps": args.steps, "micro_batch": args.micro_batch,
            "seq_len": args.seq_len, "eval_every": args.eval_every, "seed": args.seed, "runs": results}


# ---------------------------------------------------------------------------------------------------------------
# Mode 2: host bytes per parameter


def vm_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # KiB on Linux


def rss_config(name: str) -> dict:
    """configs/tiny_cpu.json (stage 2, optimizer offloaded to the CPU) at micro-batch 1 + variant ``name``'s bf16
    (and gradients on the device)."""
    cfg = json.loads((ROOT / "configs" / "tiny_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 1
    cfg["bf16"] = dict(RSS_VARIANTS[name])
    cfg["zero_optimization"]["offload_optimizer"]["gradients_on_device"] = name in GRADS_ON_DEVICE
    return cfg


def rss_child(args) -> dict:
    """One variant in this process: build, initialize, 2 steps; memory at each point."""
    import psutil
    import torch

    import zero_offload
    from zero_offload.estimate import estimate_memory
    from zero_offload.train.model import GPT, GPTConfig

    points = {"imports": vm_rss()}
    mcfg = GPTConfig(vocab_size=50304, block_size=args.rss_seq_len, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd)
    cfg = rss_config(args.rss_child)
    est = estimate_memory(mcfg, cfg, 1, micro_batch=1, seq_len=args.rss_seq_len, accelerator=False)
    predicted = {k: est.device.get(k, 0) + est.host.get(k, 0) for k in {*est.device, *est.host}}
    need = sum(predicted.values()) + points["imports"]
    available = psutil.virtual_memory().available
    if need > args.max_gib * GiB or need > 0.85 * available:
        return {"variant": args.rss_child, "skipped": f"predicted {need / GiB:.1f} GiB; limit {args.max_gib} GiB, "
                f"available {available / GiB:.1f} GiB"}
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)       # parameters born in bf16: no fp32 copy of the model
    try:
        model = GPT(mcfg)
    finally:
        torch.set_default_dtype(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    points["model_built"] = vm_rss()
    t0 = time.perf_counter()
    engine = zero_offload.initialize(model, cfg, model_parameters=model.optimizer_groups(0.1))
    points["initialized"] = vm_rss()
    points["peak_to_initialized"] = peak_rss()
    init_s = time.perf_counter() - t0
    step_s = []
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        x = torch.randint(0, mcfg.vocab_size, (1, args.rss_seq_len), generator=g)
        t0 = time.perf_counter()
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        step_s.append(round(time.perf_counter() - t0, 1))
        points[f"step{i + 1}"] = vm_rss()
        print(f"[{args.rss_child}] step {i + 1}: loss {loss.item():.4f}, {step_s[-1]} s, "
              f"RSS {points[f'step{i + 1}'] / GiB:.2f} GiB", file=sys.stderr, flush=True)
    points["peak"] = peak_rss()
    breakdown = engine.memory_breakdown()
    sides: dict[str, int] = {}
    for rec in breakdown.values():
        sides[rec["side"]] = sides.get(rec["side"], 0) + rec["bytes"]
    return {"variant": args.rss_child, "bf16": RSS_VARIANTS[args.rss_child], "params": n,
            "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "vocab": 50304,
                      "seq_len": args.rss_seq_len, "micro_batch": 1},
            "rss_bytes": points, "init_s": round(init_s, 1), "step_s": step_s,
            "rss_per_param": {k: round(v / n, 2) for k, v in points.items()},
            "rss_minus_imports_per_param": {k: round((v - points["imports"]) / n, 2) for k, v in points.items()
                                            if k != "imports"},
            "breakdown": {k: {"bytes": v["bytes"], "side": v["side"], "per_param": round(v["bytes"] / n, 3)}
                          for k, v in breakdown.items() if v["bytes"]},
            "breakdown_per_side": {k: round(v / n, 3) for k, v in sides.items()},
            # The host bytes a GPU box would hold: RSS less what the breakdown puts on the device side (on this
            # machine the device is host memory too).
            "rss_minus_imports_and_device_per_param": round((points["step2"] - points["imports"]
                                                             - sides.get("device", 0)) / n, 2),
            "predicted_per_param": {k: round(v / n, 3) for k, v in predicted.items() if v}}


def run_rss(args) -> dict:
    results = {}
    for name in args.variants or list(RSS_VARIANTS):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rss-child", name, "--n-layer", str(args.n_layer),
               "--n-embd", str(args.n_embd), "--n-head", str(args.n_head), "--rss-seq-len", str(args.rss_seq_len),
               "--max-gib", str(args.max_gib)]
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"[{name}] exited with {proc.returncode}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[name] = r
        if "skipped" in r:
            print(f"[{name}] skipped: {r['skipped']}", flush=True)
            continue
        per = r["rss_per_param"]
        print(f"[{name}] {r['params'] / 1e9:.3f}B parameters: RSS/param imports {per['imports']}, built "
              f"{per['model_built']}, initialized {per['initialized']}, step 2 {per['step2']}, peak {per['peak']}; "
              f"(RSS - imports)/param after step 2 {r['rss_minus_imports_per_param']['step2']}, less the device kinds "
              f"{r['rss_minus_imports_and_device_per_param']}", flush=True)
        print(f"[{name}] memory_breakdown per param by side: {r['breakdown_per_side']}; by kind: "
              + ", ".join(f"{k} {v['per_param']} ({v['side']})" for k, v in r["breakdown"].items()), flush=True)
    return {"mode": "rss", "runs": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rss", action="store_true", help="mode 2: host memory per parameter (default: mode 1)")
    p.add_argument("--variants", nargs="+", help=f"subset: {list(VAL_VARIANTS)} or, with --rss, {list(RSS_VARIANTS)}")
    p.add_argument("--json", help="write the results here")
    v = p.add_argument_group("mode 1 (validation loss)")
    v.add_argument("--model", default="tiny", help="preset (default tiny)")
    v.add_argument("--steps", type=int, default=100)
    v.add_argument("--micro-batch", type=int, default=4, help="train_micro_batch_size_per_gpu (tiny_cpu.json: 16)")
    v.add_argument("--seq-len", type=int, default=64)
    v.add_argument("--eval-every", type=int, default=25)
    v.add_argument("--seed", type=int, default=1337)
    v.add_argument("--out", default="runs/bench_bf16_masters", help="one directory per run, and the shared cache")
    r = p.add_argument_group("mode 2 (--rss)")
    r.add_argument("--n-layer", type=int, default=18)
    r.add_argument("--n-embd", type=int, default=2048)
    r.add_argument("--n-head", type=int, default=16)
    r.add_argument("--rss-seq-len", type=int, default=8)
    r.add_argument("--max-gib", type=float, default=16.0, help="do not start a run predicted above this")
    r.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rss_child:
        print(json.dumps(rss_child(args)), flush=True)
        return
    known = RSS_VARIANTS if args.rss else VAL_VARIANTS
    bad = [x for x in args.variants or [] if x not in known]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {list(known)}")
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}, commit {info['commit']}"
          f"{' + local changes in src/' if info['dirty'] else ''}, {info['date']}", flush=True)
    result = {**(run_rss(args) if args.rss else run_val(args)), "machine": info,
              "command": " ".join(["python", *sys.argv])}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
