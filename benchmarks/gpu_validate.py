"""One command that validates ZeRO-Offload on a GPU and measures it (issue 9, item 11).

    pip install --no-build-isolation --no-deps -e .              # no network: builds both native libraries
    python benchmarks/gpu_validate.py --out DIR                   # one CUDA GPU: the whole check, <= 9 min
    python benchmarks/gpu_validate.py --out DIR --device cpu --tiny   # the smoke run CI does (tens of s)

Before anything else it checks that the two native libraries (the host Adam kernel and the NVMe AIO path) are
built in this repository's ``src/zero_offload`` and, when one is missing, builds them in place with
``python setup.py build_ext --inplace`` (setuptools and a C compiler, no network; skipped under
``ZERO_OFFLOAD_NO_NATIVE=1``). The report gives ``native_available()`` of both (``native`` in the JSON): a
run on the torch fallback is then seen as such, not mistaken for the kernel's speed.

Writes ``DIR/gpu_validate.json`` (every number) and ``DIR/gpu_validate.md`` (tables). Sections, each in its
own subprocess with its own time limit, so a crash or an out-of-memory in one is recorded and the rest run:

(a) ``cuda_tests``: ``pytest tests/test_cuda.py`` (the CUDA-only tests: exactness against AdamW at stages 0-3
    with and without offload and DPU, pinned-byte arithmetic, export memory, overlap).
(b) ``sanitizer``: ``TORCH_CUDA_SANITIZER=1`` over 3 steps each of stage 2 + offload (pinned and pageable,
    accumulation 2) and stage 3 + offload_param + offload_optimizer; counts reported data races.
(c) ``gpt2``: GPT-2 124M, bf16, sequence 1024: peak device memory, memory resident after a step, tokens/s,
    the time split (forward, backward, exposed host step, exposed copies and collectives) and MFU against a
    measured bf16 matmul peak, for plain ``torch.optim.AdamW(fused=True)`` (fp32 weights, bf16 autocast),
    stage 2 + offload_optimizer and stage 3 + both offloads, each with DPU off and on.
(d) ``largest``: the largest GPT (hidden 4096, 32 heads) that trains 3 steps with stage 3 + both offloads +
    activation checkpointing + bf16 moments, searched over layer counts (first guess from host memory).
(e) ``gpt2_10b``: the seed's 10B GPT-2 (50 layers, hidden 4096, 32 heads) with bf16 moments and activation
    checkpointing, 5 steps, in the config `zero_offload.plan` picks for this GPU and host (its base: DeepSpeed's
    ZeRO-Offload tutorial, stage 2 + offload_optimizer): the plan and its reasons, TFLOP/s, MFU, peak device
    and host memory, host bytes per parameter.

Every engine run also reports ``estimate_device_bytes`` (`zero_offload.estimate_memory` for its model and
config) and, on CUDA, its ratio to ``torch.cuda.max_memory_allocated`` (issue 13: within 10 %).

Definitions. A step's time is wall-clock with ``torch.cuda.synchronize()`` at its end; the split
synchronises between phases (separate steps from the tokens/s ones, so the split's syncs do not slow
those). "Exposed host step" is training-thread time inside the host Adam kernel or waiting for the DPU
thread; "exposed copies" is the rest of ``engine.step()`` (norm, copies up and down, all-gathers). MFU is
``flops_per_token x tokens/s`` (6N + attention, no recomputation) over the measured peak.

Needs only torch (and this repository; setuptools and a C compiler to build the native libraries); installs
nothing; runs no DeepSpeed. Imports this repository's ``src`` first, as its section subprocesses do.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))   # this repository's code, as in the sections' subprocesses (_child_env)
SECTIONS = ("cuda_tests", "sanitizer", "gpt2", "largest", "gpt2_10b")
# Seconds per section on one H100; they sum to 8.5 min so the whole run stays under 9.
LIMITS = {"cuda_tests": 75, "sanitizer": 60, "gpt2": 120, "largest": 110, "gpt2_10b": 145}
TINY_LIMIT = 60


# -- helpers shared by the workers ------------------------------------------------------------------------
def _torch():
    import torch
    return torch


def _device(args):
    torch = _torch()
    return torch.device("cuda" if args.device == "cuda" else "cpu")


def _sync(device):
    torch = _torch()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_device_bytes(device) -> int:
    torch = _torch()
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _reset_peak(device) -> None:
    torch = _torch()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _resident_device_bytes(device) -> int:
    torch = _torch()
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def measure_matmul_peak(device, tiny: bool) -> float:
    """bf16 matmul FLOP/s measured on this device (the MFU denominator)."""
    torch = _torch()
    n = 256 if tiny else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    reps = 3 if tiny else 50
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


def gpt_config(name: str, tiny: bool, **overrides):
    from zero_offload.train.model import GPTConfig, preset
    if tiny:
        small = dict(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
        small.update({k: v for k, v in overrides.items() if k in ("activation_checkpointing",)})
        return GPTConfig(**small)
    return preset(name, **overrides) if name in ("gpt2", "gpt2-10b") else GPTConfig(**overrides)


def engine_config(stage: int, offload_param: bool, dpu: bool, micro: int, gas: int = 1, pin: bool = True,
                  bf16_states: bool = False, precision: str = "bf16") -> dict:
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 200_000_000,
            "offload_optimizer": {"device": "cpu", "pin_memory": pin, "delayed_param_update": dpu,
                                  "dpu_warmup_steps": 1}}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
           "zero_optimization": zero, "gradient_clipping": 1.0}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True, "bf16_optimizer_states": bf16_states}
    return cfg


def build_model(cfg, device, dtype, sharded: bool):
    """The GPT built where it will live: on the meta device under stage 3, else straight on ``device``."""
    torch = _torch()
    import zero_offload
    from zero_offload.train.model import GPT
    if sharded:
        with zero_offload.init_sharded():
            return GPT(cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return GPT(cfg)
    finally:
        torch.set_default_dtype(previous)


class ExposedHostTime:
    """Training-thread seconds spent in the host Adam kernel or waiting for the DPU thread."""

    def __init__(self, engine):
        self.seconds = 0.0
        main = threading.main_thread()
        for owner, name in ((engine.zero.adam, "_host_step"), (getattr(engine, "_dpu", None), "wait")):
            if owner is None:
                continue
            inner = getattr(owner, name)

            def timed(*a, _inner=inner, **k):
                if threading.current_thread() is not main:
                    return _inner(*a, **k)
                start = time.perf_counter()
                try:
                    return _inner(*a, **k)
                finally:
                    self.seconds += time.perf_counter() - start
            setattr(owner, name, timed)


def batches(vocab: int, micro: int, seq: int, device, n: int):
    torch = _torch()
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        data = torch.randint(0, vocab, (micro, seq + 1), generator=g)
        out.append((data[:, :-1].to(device), data[:, 1:].to(device)))
    return out


def run_engine(cfg_model, config: dict, device, steps: int, split_steps: int, sharded: bool):
    """Train with the engine; tokens/s over ``steps`` timed steps, then the split over ``split_steps``."""
    torch = _torch()
    import zero_offload
    from zero_offload.train.model import flops_per_token
    _reset_peak(device)
    model = build_model(cfg_model, device, torch.bfloat16, sharded)
    engine = zero_offload.initialize(model, config)   # stage 3: each module's reset_parameters()
    exposed = ExposedHostTime(engine)
    micro, gas = engine.train_micro_batch_size_per_gpu, engine.gradient_accumulation_steps
    seq = cfg_model.block_size
    data = batches(cfg_model.vocab_size, micro, seq, device, 4)

    def one_step(split: dict | None):
        for k in range(gas):
            x, y = data[k % len(data)]
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            if split is not None:
                _sync(device)
                split["forward_s"] += time.perf_counter() - t0
            t1 = time.perf_counter()
            engine.backward(loss)
            if split is not None:
                _sync(device)
                split["backward_s"] += time.perf_counter() - t1
        t2 = time.perf_counter()
        before = exposed.seconds
        engine.step()
        _sync(device)
        if split is not None:
            split["step_s"] += time.perf_counter() - t2
            split["exposed_host_step_s"] += exposed.seconds - before
        return float(loss)

    warmup = 2
    for _ in range(warmup):
        one_step(None)
    _sync(device)
    start = time.perf_counter()
    losses = [one_step(None) for _ in range(steps)]
    elapsed = time.perf_counter() - start
    resident = _resident_device_bytes(device)
    split = dict.fromkeys(("forward_s", "backward_s", "step_s", "exposed_host_step_s"), 0.0)
    for _ in range(split_steps):
        one_step(split)
    split = {k: v / max(split_steps, 1) for k, v in split.items()}
    split["exposed_copies_s"] = max(0.0, split["step_s"] - split["exposed_host_step_s"])
    tokens = micro * gas * seq * steps
    breakdown = engine.memory_breakdown()
    host_state = sum(v["bytes"] for v in breakdown.values() if v["side"] == "host")
    from zero_offload.estimate import estimate_memory      # issue 13: the model against the allocator's peak
    estimate = estimate_memory(cfg_model, config, micro_batch=micro, seq_len=seq,
                               accelerator=device.type == "cuda").device_bytes
    n_params = sum(p.numel() for p in engine.module.parameters()) if not sharded else \
        sum(u.numel for u in engine.zero.units)
    peak = _peak_device_bytes(device)
    return {"tokens_per_s": tokens / elapsed, "step_s": elapsed / steps, "losses": losses,
            "peak_device_bytes": peak, "resident_device_bytes": resident, "estimate_device_bytes": estimate,
            "estimate_over_peak": estimate / peak if device.type == "cuda" else None,
            "peak_rss_bytes": _peak_rss_bytes(), "host_state_bytes": host_state, "params": n_params,
            "host_bytes_per_param": host_state / max(n_params, 1),
            "flops_per_token": flops_per_token(cfg_model, seq), "split": split,
            "stats": engine.stats.as_dict(),   # the last step: gathers, reductions, bytes each way, host syncs
            "memory_breakdown": breakdown}


def run_plain(cfg_model, device, micro: int, steps: int, split_steps: int):
    """Plain torch: fp32 weights, bf16 autocast, torch.optim.AdamW(fused=True) on the device."""
    torch = _torch()
    from zero_offload.train.model import flops_per_token
    _reset_peak(device)
    model = build_model(cfg_model, device, torch.float32, sharded=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    seq = cfg_model.block_size
    data = batches(cfg_model.vocab_size, micro, seq, device, 4)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def one_step(i, split):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        with autocast:
            _, loss = model(x, y)
        if split is not None:
            _sync(device)
            split["forward_s"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        loss.backward()
        if split is not None:
            _sync(device)
            split["backward_s"] += time.perf_counter() - t1
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _sync(device)
        if split is not None:
            split["step_s"] += time.perf_counter() - t2
        return loss

    for i in range(2):
        one_step(i, None)
        opt.zero_grad(set_to_none=True)
    _sync(device)
    start = time.perf_counter()
    for i in range(steps):
        one_step(i, None)
        if i < steps - 1:
            opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    resident = _resident_device_bytes(device)
    opt.zero_grad(set_to_none=True)
    split = dict.fromkeys(("forward_s", "backward_s", "step_s"), 0.0)
    for i in range(split_steps):
        one_step(i, split)
        opt.zero_grad(set_to_none=True)
    split = {k: v / max(split_steps, 1) for k, v in split.items()}
    split.update(exposed_host_step_s=0.0, exposed_copies_s=0.0)
    n_params = sum(p.numel() for p in model.parameters())
    return {"tokens_per_s": micro * seq * steps / elapsed, "step_s": elapsed / steps,
            "peak_device_bytes": _peak_device_bytes(device), "resident_device_bytes": resident,
            "peak_rss_bytes": _peak_rss_bytes(), "params": n_params,
            "flops_per_token": flops_per_token(cfg_model, seq), "split": split}


# -- the sections (each runs in its own process) ------------------------------------------------------------
def section_cuda_tests(args) -> dict:
    target = str(ROOT / "tests" / "test_cuda.py")
    if args.device != "cuda":
        # No GPU: every test skips; collect in this process (one torch import) to check the file still loads.
        import pytest
        code = int(pytest.main(["-q", "-p", "no:cacheprovider", target]))
        return {"returncode": code, "summary": "collected and skipped (no CUDA)", "ok": code in (0, 5)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_child_env())
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"returncode": proc.returncode, "summary": tail[-1] if tail else "", "tail": tail,
            "ok": proc.returncode == 0}


def section_sanitizer(args) -> dict:
    if args.device != "cuda":
        sanitize_body(args)    # CSAN exists only on CUDA: run the same steps without it
        return {"returncode": 0, "data_races": 0, "ok": True, "sanitizer": False}
    env = dict(_child_env(), TORCH_CUDA_SANITIZER="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_sanitize_body", "--device", args.device]
    if args.tiny:
        cmd.append("--tiny")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    text = proc.stdout + proc.stderr
    races = text.count("CSAN detected a possible data race")
    return {"returncode": proc.returncode, "data_races": races, "ok": proc.returncode == 0 and races == 0,
            "sanitizer": True, "tail": text.strip().splitlines()[-20:]}


def sanitize_body(args) -> None:
    """3 steps of each offload configuration, run under TORCH_CUDA_SANITIZER=1 by `section_sanitizer`."""
    device = _device(args)
    cfg = gpt_config("tiny", True)
    for name, config, sharded in (
            ("stage2-offload-pinned-gas2", engine_config(2, False, False, 1, gas=2, pin=True), False),
            ("stage2-offload-pageable-gas2", engine_config(2, False, False, 1, gas=2, pin=False), False),
            ("stage2-offload-dpu", engine_config(2, False, True, 1), False),
            ("stage3-offload-both", engine_config(3, True, False, 1), True)):
        result = run_engine(cfg, config, device, steps=1, split_steps=0, sharded=sharded)
        print(name, "loss", result["losses"][-1], flush=True)


def section_gpt2(args) -> dict:
    device = _device(args)
    cfg = gpt_config("gpt2", args.tiny)
    micro = 2 if args.tiny else 8
    steps, split_steps = (2, 1) if args.tiny else (6, 2)
    peak = measure_matmul_peak(device, args.tiny)
    runs = {"plain-adamw": run_plain(cfg, device, micro, steps, split_steps)}
    for name, stage, offload_param in (("stage2-offload", 2, False), ("stage3-offload-both", 3, True)):
        for dpu in (False, True):
            key = f"{name}{'-dpu' if dpu else ''}"
            runs[key] = run_engine(cfg, engine_config(stage, offload_param, dpu, micro), device, steps,
                                   split_steps, sharded=stage == 3)
    for r in runs.values():
        r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak
        r.pop("memory_breakdown", None)
    base = runs["plain-adamw"]
    for r in runs.values():
        r["tokens_per_s_vs_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["resident_device_reduction_vs_plain"] = base["resident_device_bytes"] / max(r["resident_device_bytes"], 1)
    return {"matmul_peak_flops": peak, "micro_batch": micro, "seq_len": cfg.block_size, "runs": runs, "ok": True}


def _try_layers(args, layers: int, budget_s: float) -> dict:
    """One attempt of section (d) in its own process (an out-of-memory must not end the search)."""
    if args.tiny:
        import contextlib
        import io
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            largest_body(args, layers)
        return {"layers": layers, "ok": True, **json.loads(buf.getvalue().splitlines()[-1])}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_largest_body", str(layers), "--device", args.device]
    if args.tiny:
        cmd.append("--tiny")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_child_env(),
                              timeout=max(10.0, budget_s))
    except subprocess.TimeoutExpired:
        return {"layers": layers, "ok": False, "error": "timed out"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return {"layers": layers, "ok": True, **json.loads(lines[-1])}
    return {"layers": layers, "ok": False, "error": (proc.stdout + proc.stderr).strip().splitlines()[-3:]}


def largest_body(args, layers: int) -> None:
    device = _device(args)
    overrides = dict(n_layer=layers, n_head=32, n_embd=4096, vocab_size=50257, block_size=1024,
                     activation_checkpointing=True)
    cfg = gpt_config("custom", args.tiny, **({"activation_checkpointing": True} if args.tiny else overrides))
    if args.tiny:
        from dataclasses import replace
        cfg = replace(cfg, n_layer=layers)
    result = run_engine(cfg, engine_config(3, True, False, 1, bf16_states=True), device, steps=1,
                        split_steps=0, sharded=True)
    print(json.dumps({"params": result["params"], "peak_device_bytes": result["peak_device_bytes"],
                      "peak_rss_bytes": result["peak_rss_bytes"], "step_s": result["step_s"]}), flush=True)


def section_largest(args) -> dict:
    from zero_offload.train.model import GPTConfig, count_parameters
    if args.tiny:
        guesses = [2, 4]
    else:
        per_layer = count_parameters(GPTConfig(vocab_size=50257, block_size=1024, n_layer=1, n_head=32,
                                               n_embd=4096)).non_embedding
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        # stage 3 + both offloads + bf16 moments: ~12 host bytes/param (bf16 shard and gradient, fp32 master,
        # two bf16 moments); leave a fifth of host memory to the rest of the process.
        first = max(1, int(0.8 * host / 12 / per_layer))
        guesses = [first, int(first * 0.8), int(first * 0.6)]
    attempts, best = [], None
    deadline = time.monotonic() + (TINY_LIMIT if args.tiny else LIMITS["largest"] - 10)
    for layers in guesses:
        if time.monotonic() > deadline:
            break
        attempt = _try_layers(args, layers, deadline - time.monotonic())
        attempts.append(attempt)
        if attempt["ok"]:
            best = attempt
            if not args.tiny:
                break
    return {"attempts": attempts, "largest": best, "ok": best is not None}


def section_gpt2_10b(args) -> dict:
    device = _device(args)
    cfg = gpt_config("gpt2-10b", args.tiny, activation_checkpointing=True)
    micro = 1 if args.tiny else 8
    steps = 2 if args.tiny else 3      # + 2 warm-up steps = 5 steps
    peak = measure_matmul_peak(device, args.tiny)
    # Issue 13: train what the planner picks for this GPU and host (the tutorial's stage 2 + offload_optimizer
    # with bf16 moments is its base config), and record the plan beside the run.
    import psutil
    from zero_offload.estimate import plan
    base = engine_config(2, False, False, micro, bf16_states=True)
    gpu_memory = _torch().cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    chosen = plan(cfg, gpus=1, gpu_memory=gpu_memory, host_memory=psutil.virtual_memory().total,
                  micro_batch=micro, seq_len=cfg.block_size, config=base)
    config = chosen.config if chosen.fits else base
    result = run_engine(cfg, config, device, steps, split_steps=0, sharded=config["zero_optimization"]["stage"] == 3)
    result["plan"] = {"fits": chosen.fits, "name": chosen.name, "reasons": chosen.reasons,
                      "zero_optimization": config["zero_optimization"], "trained": "plan" if chosen.fits else
                      f"the tutorial config (no plan fits: {chosen.message()})"}
    result["tflops"] = result["flops_per_token"] * result["tokens_per_s"] / 1e12
    result["mfu"] = result["flops_per_token"] * result["tokens_per_s"] / peak
    result["matmul_peak_flops"] = peak
    result["memory_breakdown"] = {k: v["bytes"] for k, v in result["memory_breakdown"].items()}
    result["ok"] = True
    return result


BODIES = {"cuda_tests": section_cuda_tests, "sanitizer": section_sanitizer, "gpt2": section_gpt2,
          "largest": section_largest, "gpt2_10b": section_gpt2_10b}


# -- the driver -----------------------------------------------------------------------------------------------
def ensure_native(root: Path = ROOT) -> dict:
    """Build the native libraries in ``root`` (a checkout: ``setup.py``, ``src/zero_offload``) when one is missing.

    Runs ``python setup.py build_ext --inplace`` in ``root`` (no network: setuptools and a C compiler), which
    puts the ``.so`` files next to their C sources, where the loaders look. Skipped when every library is
    there, or under ``ZERO_OFFLOAD_NO_NATIVE=1`` (the run is meant to use the fallbacks). Never raises: a build
    that fails is recorded and the run goes on with the fallbacks, which the report then shows.

    Returns:
        {"missing": names missing before, "built": whether a build ran, "returncode": its exit status or None,
        "still_missing": names missing after, "log": the build's last output lines (on failure)}.
    """
    from zero_offload.native import missing_libraries, native_disabled
    package = root / "src" / "zero_offload"
    missing = missing_libraries(package)
    result = {"missing": missing, "built": False, "returncode": None, "still_missing": missing, "log": []}
    if not missing:
        return result
    if native_disabled():
        print(f"gpu_validate: native libraries missing ({', '.join(missing)}); not built: "
              f"ZERO_OFFLOAD_NO_NATIVE is set", flush=True)
        return result
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    print(f"gpu_validate: native libraries missing ({', '.join(missing)}): building them with "
          f"`{' '.join(cmd[1:])}` in {root}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
        code, text = proc.returncode, proc.stdout + proc.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        code, text = -1, f"{type(e).__name__}: {e}"
    still = missing_libraries(package)
    result.update(built=True, returncode=code, still_missing=still)
    if code != 0 or still:
        result["log"] = text.strip().splitlines()[-20:]
        print(f"gpu_validate: the build left {', '.join(still) or 'nothing'} missing (exit {code}); running on "
              f"the fallbacks. Its last lines:\n  " + "\n  ".join(result["log"]), flush=True)
    else:
        print("gpu_validate: built " + ", ".join(missing), flush=True)
    return result


def native_report(build: dict) -> dict:
    """``native_available()`` of both libraries in this process, with the build record of `ensure_native`."""
    from zero_offload.native import native_available
    return {"available": native_available(), "build": build}


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    return env


def run_section(args, name: str) -> dict:
    if args.tiny:   # the smoke run: every section in this process, one torch import
        start = time.monotonic()
        try:
            result = BODIES[name](args)
        except Exception:
            result = {"ok": False, "error": traceback.format_exc().strip().splitlines()[-12:]}
        result["wall_s"] = round(time.monotonic() - start, 1)
        return json.loads(json.dumps(result, default=str))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_section", name, "--device", args.device,
           "--out", str(args.out)]
    if args.tiny:
        cmd.append("--tiny")
    limit = TINY_LIMIT if args.tiny else LIMITS[name]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_child_env(), timeout=limit)
        path = Path(args.out) / f"section_{name}.json"
        if proc.returncode == 0 and path.exists():
            result = json.loads(path.read_text())
        else:
            result = {"ok": False, "error": (proc.stdout + proc.stderr).strip().splitlines()[-12:]}
    except subprocess.TimeoutExpired:
        result = {"ok": False, "error": f"timed out after {limit} s"}
    result["wall_s"] = round(time.monotonic() - start, 1)
    return result


def _gib(n) -> str:
    return f"{n / 2**30:.2f}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _build_note(build: dict) -> str:
    if not build["built"]:
        return ""
    if build["still_missing"]:
        return f" (this run's build failed, exit {build['returncode']}: {', '.join(build['still_missing'])} missing)"
    return " (built by this run)"


def markdown(report: dict) -> str:
    lines = [f"# gpu_validate ({report['device_name']}, torch {report['torch']})", "",
             f"Command: `{report['command']}`; total {report['wall_s']} s.", "",
             "native_available(): " + ", ".join(f"{k} {v}" for k, v in report["native"]["available"].items())
             + _build_note(report["native"]["build"]), "",
             "| section | ok | wall s |", "| --- | --- | --- |"]
    for name in SECTIONS:
        if name in report["sections"]:
            s = report["sections"][name]
            lines.append(f"| {name} | {s.get('ok')} | {s.get('wall_s')} |")
    gpt2 = report["sections"].get("gpt2", {})
    if gpt2.get("runs"):
        lines += ["", f"## (c) gpt2, bf16, seq {gpt2['seq_len']}, micro-batch {gpt2['micro_batch']}", "",
                  "| run | tokens/s | vs plain | MFU | peak dev GiB | estimate / peak | resident dev GiB | fwd s | "
                  "bwd s | exposed host step s | exposed copies s |", "| --- |" + " --- |" * 10]
        for key, r in gpt2["runs"].items():
            s = r["split"]
            lines.append(f"| {key} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_vs_plain']:.2f} | {r['mfu']:.3f} | "
                         f"{_gib(r['peak_device_bytes'])} | {_ratio(r.get('estimate_over_peak'))} | "
                         f"{_gib(r['resident_device_bytes'])} | {s['forward_s']:.4f} | {s['backward_s']:.4f} | "
                         f"{s['exposed_host_step_s']:.4f} | "
                         f"{s['exposed_copies_s']:.4f} |")
    largest = report["sections"].get("largest", {})
    if largest.get("largest"):
        b = largest["largest"]
        lines += ["", f"## (d) largest GPT, stage 3 + both offloads: {b['layers']} layers, "
                      f"{b['params'] / 1e9:.2f} B params, peak device {_gib(b['peak_device_bytes'])} GiB, "
                      f"peak host RSS {_gib(b['peak_rss_bytes'])} GiB"]
    big = report["sections"].get("gpt2_10b", {})
    if big.get("ok"):
        lines += ["", f"## (e) 10B GPT-2, bf16 moments, the planned config: {big['plan']['name']} "
                      f"({big['plan']['trained']})", "",
                  f"{big['params'] / 1e9:.2f} B params; {big['tflops']:.1f} TFLOP/s; MFU {big['mfu']:.3f}; "
                  f"peak device {_gib(big['peak_device_bytes'])} GiB (estimate / peak "
                  f"{_ratio(big.get('estimate_over_peak'))}); peak host RSS {_gib(big['peak_rss_bytes'])} "
                  f"GiB; host state {big['host_bytes_per_param']:.2f} B/param"]
    for name, s in report["sections"].items():
        if not s.get("ok") and s.get("error"):
            lines += ["", f"## {name} failed", "", "```", *map(str, s["error"] if isinstance(s["error"], list)
                                                               else [s["error"]]), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_validate_out"), help="directory for the reports")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke run of every section")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset to run")
    parser.add_argument("--_section", help=argparse.SUPPRESS)
    parser.add_argument("--_sanitize_body", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_largest_body", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._sanitize_body:
        sanitize_body(args)
        return 0
    if args._largest_body is not None:
        largest_body(args, args._largest_body)
        return 0
    if args._section:
        args.out.mkdir(parents=True, exist_ok=True)
        try:
            result = BODIES[args._section](args)
        except Exception:
            result = {"ok": False, "error": traceback.format_exc().strip().splitlines()[-12:]}
        (args.out / f"section_{args._section}.json").write_text(json.dumps(result, indent=1, default=str))
        return 0
    torch = _torch()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --device cpu --tiny for the smoke run)")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    wanted = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    native = native_report(ensure_native())     # before anything loads a library (the loaders cache)
    print(f"native_available: {native['available']}", flush=True)
    report = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "device": args.device, "tiny": args.tiny, "torch": torch.__version__,
              "python": platform.python_version(), "host_cores": os.cpu_count(),
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
              "native": native, "sections": {}}
    for name in wanted:
        report["sections"][name] = run_section(args, name)
        print(f"{name}: ok={report['sections'][name].get('ok')} ({report['sections'][name]['wall_s']} s)",
              flush=True)
    report["wall_s"] = round(time.monotonic() - start, 1)
    (args.out / "gpu_validate.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "gpu_validate.md").write_text(markdown(report))
    print(f"wrote {args.out / 'gpu_validate.json'} and {args.out / 'gpu_validate.md'}")
    return 0 if all(s.get("ok") for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
