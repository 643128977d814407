"""One command that validates ZeRO-Offload on a GPU and measures it (issues 9, 13, 20 and 27).

On a GPU machine with no network, the default run fits one 9-minute call (289 s on an H200, the build included):

    python benchmarks/gpu_validate.py --out $OUT          # calibrate, cuda_tests, sanitizer, gpt2, gpt2_10b(_dpu)
    python benchmarks/gpu_validate.py --out $OUT --sections largest      # <= 5 min
    python benchmarks/gpu_validate.py --out $OUT --sections largest_planned      # <= 7 min
    python benchmarks/gpu_validate.py --out $OUT --sections two_gpus     # 2+ GPUs, <= 2.5 min
    python benchmarks/gpu_validate.py --out DIR --device cpu --tiny      # the smoke run CI does (tens of s)

Before anything else it checks that the two native libraries (the host Adam kernel and the NVMe AIO path) are built
in this repository's ``src/zero_offload`` and, when one is missing, builds them in place with ``python setup.py
build_ext --inplace`` (setuptools and a C compiler, no network; skipped under ``ZERO_OFFLOAD_NO_NATIVE=1``).

Writes ``DIR/gpu_validate.json`` (every number) and ``DIR/gpu_validate.md`` (tables). Each section runs in its own
subprocess with its own time limit (`LIMITS`), so a crash or an out-of-memory in one is recorded and the rest run:

(0) ``calibrate``: `zero_offload.calibrate.measure` (bf16 matmul, pinned copies each way, host Adam at the delayed
    step's thread count and at every core), written to ``DIR/calibration.json`` for ``zero-offload estimate
    --calibration``.
(a) ``cuda_tests``: ``pytest tests/test_cuda.py`` (the CUDA-only tests, offload_states included).
(b) ``sanitizer``: ``TORCH_CUDA_SANITIZER=1`` over stage 2 + offload (pinned and pageable, accumulation 2, DPU,
    super_offload, ratio 0.5 with super_offload) and stage 3 + both offloads (plain, super_offload); counts reported
    data races.
(c) ``gpt2``: GPT-2 124M, bf16, sequence 1024, micro-batch 8: plain ``torch.optim.AdamW(fused=True)`` against
    stage 2 + offload_optimizer and stage 3 + both offloads, each plain, with DPU, and with super_offload (with
    ``gradient_clipping`` 1.0 as every run, where the speculated step is redone whenever clipping fires, and 0),
    and at stage 2 with ``offload_optimizer.ratio`` 0.5, alone and with super_offload.
(c'') ``gpt2_xl`` (not in the default run): GPT-2 XL (1.56B), activation checkpointing, micro-batch 16: plain AdamW
    against stage 2 + offload_optimizer with the same six variants (issue 28's >= 0.9x target).
(c') ``gpt2_compiled`` (not in the default run): the same GPT-2 124M, plain AdamW eager and compiled, stage 2 +
    offload + DPU and stage 3 + both offloads compiled with ``engine.compile()`` (issue 29; inductor).
(d) ``largest``: the largest GPT (hidden 4096, 32 heads) that trains with stage 3 + both offloads + activation
    checkpointing + bf16 moments: it starts at 2 layers and doubles, then bisects, while the section's budget
    allows the next try (each try's time predicted from the last one's).
(d') ``largest_planned`` (issue 42): the largest model ``zero-offload estimate --largest --allow-bf16-masters``
    names for this GPU and host, trained with its plan for a few steps: MFU, peak device memory and host RSS
    against the estimate (`gpu_planned`).
(d'') ``llama_trainer`` (issue 41, item 5): Llama 3 8B's shape (random init, bf16) through `zero_offload.hf.Trainer`
    with the planner's exact plan: tokens/s, MFU, peak device memory and host RSS against the estimate, the
    predicted step beside the measured one (`gpu_trainer`).
(e) ``gpt2_10b`` and ``gpt2_10b_dpu``: the seed's 10B GPT-2 in a pinned config (stage 2, optimizer offloaded with
    bf16 moments, activation checkpointing, micro-batch 16, accumulation 1), without and with the delayed update,
    for 8 timed steps on distinct batches (every step's loss reported), beside the step the planner's model
    predicts for it on an 80 GB GPU and this host.
(d''') ``long_seq`` (issue 58, item 5; not in the default run, a call of its own): Llama 3 8B's shape at the longest
    sequence ``zero-offload estimate --longest`` names for this GPU and host, one step with ALST's parts (stage 3
    with both offloads, block inputs in host memory, tiled MLPs and loss), peaks against the estimate (`gpu_long_seq`).
(f) ``two_gpus``: two processes under an NCCL-only process group that the script creates itself (no
    ``set_device``): each binds ``cuda:LOCAL_RANK``, builds a GPT under ``init_sharded`` and trains it at stage 3;
    skipped, with a note, on fewer than 2 GPUs.

Every engine run reports (`gpu_measure`): whether the native host kernel ran, tokens/s (and against plain AdamW
where the model fits there), ``engine.timings`` (on CUDA device time from CUDA events: forward, backward,
optimizer, the host step's exposed time, its own duration and thread count), from a ``torch.profiler`` trace of two
steps: host syncs per step with their summed time, event syncs likewise, the device-idle share (1 - union of
kernel time / step), each direction's copy time, bytes, achieved GB/s and share overlapped with kernels; the
process's cores and torch threads, and peak device memory against ``estimate_memory``. Each engine is freed before
the next.

Needs only torch (and this repository); installs nothing; runs no DeepSpeed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))   # this repository's code, as in the sections' subprocesses (_child_env)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_measure as gm  # noqa: E402
from gpu_native import ensure_native, native_report  # noqa: E402,F401 (ensure_native: tests call it here)
from gpu_planned import section_largest_planned  # noqa: E402
from gpu_muon import section_muon  # noqa: E402
from gpu_trainer import section_llama_trainer  # noqa: E402
from gpu_long_seq import LIMIT_S as LONG_SEQ_LIMIT_S, section_long_seq  # noqa: E402
from gpu_report import markdown  # noqa: E402

SECTIONS = ("calibrate", "cuda_tests", "sanitizer", "gpt2", "gpt2_xl", "gpt2_compiled", "gpt2_10b", "gpt2_10b_dpu",
            "largest", "largest_planned", "two_gpus", "muon", "llama_trainer", "long_seq")
# The default run: what matters most, inside one 9-minute call with the native build (issue 27, item 8).
DEFAULT_SECTIONS = ("calibrate", "cuda_tests", "sanitizer", "gpt2", "gpt2_10b", "gpt2_10b_dpu")
# Seconds per section on one H100 (the default sections sum to 520 s; the build takes ~20 s).
LIMITS = {"calibrate": 45, "cuda_tests": 80, "sanitizer": 40, "gpt2": 110, "gpt2_xl": 200, "gpt2_compiled": 240,
          "gpt2_10b": 150,
          "gpt2_10b_dpu": 150,
          "largest": 300, "largest_planned": 420, "two_gpus": 150, "muon": 300, "llama_trainer": 420,
          "long_seq": LONG_SEQ_LIMIT_S}
# The 10B model's pinned config (the same every run, so runs compare): stage 2, optimizer offloaded with bf16
# moments, activation checkpointing, micro-batch 16 x 1024 tokens, no accumulation.
TEN_B_MICRO = 16
TEN_B_STEPS = 8
TINY_LIMIT = 60


def _device(args):
    import torch
    return torch.device("cuda" if args.device == "cuda" else "cpu")


def measure_matmul_peak(device, tiny: bool) -> float:
    """bf16 matmul FLOP/s measured on this device (the MFU denominator)."""
    import torch
    n = 256 if tiny else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    gm.free()
    reps = 3 if tiny else 50
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


def gpt_config(name: str, tiny: bool, **overrides):
    from zero_offload.train.model import GPTConfig, preset
    if tiny:
        small = dict(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
        small.update({k: v for k, v in overrides.items() if k in ("activation_checkpointing", "n_layer")})
        return GPTConfig(**small)
    return preset(name, **overrides) if name in ("gpt2", "gpt2-10b") else GPTConfig(**overrides)


def engine_config(stage: int, offload_param: bool, dpu: bool, micro: int, gas: int = 1, pin: bool = True,
                  bf16_states: bool = False, precision: str = "bf16", super_offload: bool = False,
                  clip: float = 1.0, ratio: float = 1.0) -> dict:
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 200_000_000,
            "offload_optimizer": {"device": "cpu", "pin_memory": pin, "delayed_param_update": dpu,
                                  "dpu_warmup_steps": 1, "super_offload": super_offload, "ratio": ratio}}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
           "zero_optimization": zero, "gradient_clipping": clip}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True, "bf16_optimizer_states": bf16_states}
    return cfg


# -- the sections (each runs in its own process) ------------------------------------------------------------
def section_calibrate(args) -> dict:
    """`zero_offload.calibrate.measure` on this machine, written to ``OUT/calibration.json``."""
    from zero_offload.calibrate import measure, write
    result = measure("cuda" if args.device == "cuda" else "cpu", host_elems=1 << 20 if args.tiny else 1 << 27)
    write(result, Path(args.out) / "calibration.json")
    return {**result, "ok": True}


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
    """The CUDA sanitizer (CSAN) over the offload configurations. What it cannot see: it checks device tensors
    only (a host write to a pinned slot racing its copy is the simulated streams' job: tests/test_simulated_
    streams.py), it forgets a block's accesses when the block is freed (a missing ``record_stream`` does not show),
    it compares exact data pointers (not overlapping slices), and it stops at the first race."""
    if args.device != "cuda":
        sanitize_body(args)    # CSAN exists only on CUDA: run the same steps without it
        return {"returncode": 0, "data_races": 0, "ok": True, "sanitizer": False}
    env = dict(_child_env(), TORCH_CUDA_SANITIZER="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_sanitize_body", "--device", args.device]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    text = proc.stdout + proc.stderr
    races = text.count("CSAN detected a possible data race")
    return {"returncode": proc.returncode, "data_races": races, "ok": proc.returncode == 0 and races == 0,
            "sanitizer": True, "tail": text.strip().splitlines()[-20:]}


def sanitize_body(args) -> None:
    """One timed step of each offload configuration, run under TORCH_CUDA_SANITIZER=1 by `section_sanitizer`."""
    device = _device(args)
    cfg = gpt_config("tiny", True)
    for name, config, sharded in (
            ("stage2-offload-pinned-gas2", engine_config(2, False, False, 1, gas=2, pin=True), False),
            ("stage2-offload-pageable-gas2", engine_config(2, False, False, 1, gas=2, pin=False), False),
            ("stage2-offload-dpu", engine_config(2, False, True, 1), False),
            ("stage3-offload-both", engine_config(3, True, False, 1), True),
            ("stage2-offload-super-gas2", engine_config(2, False, False, 1, gas=2, super_offload=True, clip=0.0),
             False),
            ("stage3-offload-both-super", engine_config(3, True, False, 1, super_offload=True, clip=0.0), True),
            ("stage2-offload-ratio0.5-super-gas2", engine_config(2, False, False, 1, gas=2, super_offload=True,
                                                                 clip=0.0, ratio=0.5), False)):
        result = gm.run_engine(cfg, config, device, steps=1, split_steps=0, sharded=sharded, profile=False)
        print(name, "loss", result["losses"][-1], flush=True)


def section_gpt2(args) -> dict:
    device = _device(args)
    cfg = gpt_config("gpt2", args.tiny)
    micro = 2 if args.tiny else 8
    steps, split_steps = (2, 1) if args.tiny else (6, 2)
    return _compare(args, cfg, micro, steps, split_steps, ((2, False), (3, True)))


def section_gpt2_xl(args) -> dict:
    """GPT-2 XL (1.56B) with activation checkpointing, micro-batch 16: plain AdamW, ZeRO-2 + offload plain, delayed
    and speculated (issue 28's >= 0.9x target)."""
    depth = {} if args.tiny else {"n_layer": 48}      # the smoke run keeps the tiny model's depth
    cfg = gpt_config("custom", args.tiny, **depth, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024,
                     activation_checkpointing=True)
    micro = 2 if args.tiny else 16
    steps, split_steps = (2, 1) if args.tiny else (4, 1)
    return _compare(args, cfg, micro, steps, split_steps, ((2, False),))


def _compare(args, cfg, micro: int, steps: int, split_steps: int, stages) -> dict:
    """Plain AdamW, then per (stage, offload_param) in ``stages`` the engine with the optimizer offloaded: plain,
    delayed update, super_offload with the clipping every run has (redone wherever it fires) and without, and with
    the parameters on the device ``ratio`` 0.5 alone and with super_offload."""
    device = _device(args)
    peak = measure_matmul_peak(device, args.tiny)
    runs = {"plain-adamw": gm.run_plain(cfg, device, micro, steps)}
    for stage, offload_param in stages:
        name = "stage3-offload-both" if offload_param else f"stage{stage}-offload"
        variants = {"": {}, "-dpu": {"dpu": True}, "-super": {"super_offload": True},
                    "-super-noclip": {"super_offload": True, "clip": 0.0}}
        if not offload_param:     # ratio < 1 steps device parameters: half of the state on the device
            variants.update({"-ratio0.5": {"ratio": 0.5}, "-ratio0.5-super": {"ratio": 0.5, "super_offload": True}})
        for suffix, kw in variants.items():
            config = engine_config(stage, offload_param, kw.pop("dpu", False), micro, **kw)
            runs[name + suffix] = gm.run_engine(cfg, config, device, steps, split_steps, sharded=stage == 3)
    base = runs["plain-adamw"]
    for r in runs.values():
        r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak
        r["tokens_per_s_vs_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["speculative_state_bytes"] = r.pop("memory_breakdown", {}).get("speculative_state", 0)
    return {"matmul_peak_flops": peak, "micro_batch": micro, "seq_len": cfg.block_size, "runs": runs, "ok": True}


def section_gpt2_compiled(args) -> dict:
    """GPT-2 124M as in `section_gpt2`, each model compiled (issue 29): plain AdamW eager and compiled, stage 2 +
    offload + DPU and stage 3 + both offloads compiled with ``engine.compile()`` (inductor on a GPU; aot_eager in
    the CPU smoke run, which needs no C compiler)."""
    device = _device(args)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    cfg = gpt_config("gpt2", args.tiny)
    micro = 2 if args.tiny else 8
    steps = 2 if args.tiny else 6
    runs = {"plain-adamw": gm.run_plain(cfg, device, micro, steps, profile=False),
            "plain-adamw-compiled": gm.run_plain(cfg, device, micro, steps, profile=False, compile_backend=backend)}
    for name, stage, offload_param, dpu in (("stage2-offload-dpu-compiled", 2, False, True),
                                            ("stage3-offload-both-compiled", 3, True, False)):
        runs[name] = gm.run_engine(cfg, engine_config(stage, offload_param, dpu, micro), device, steps, 0,
                                   sharded=stage == 3, profile=False, compile_backend=backend)
    base = runs["plain-adamw"]
    for r in runs.values():
        r["tokens_per_s_vs_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
        r.pop("memory_breakdown", None)
    return {"backend": backend, "micro_batch": micro, "seq_len": cfg.block_size, "runs": runs, "ok": True}


def largest_body(args, layers: int) -> None:
    device = _device(args)
    cfg = gpt_config("custom", args.tiny, n_layer=layers, n_head=32, n_embd=4096, vocab_size=50257,
                     block_size=1024, activation_checkpointing=True)
    result = gm.run_engine(cfg, engine_config(3, True, False, 1, bf16_states=True), device, steps=1,
                           split_steps=1, sharded=True)
    keys = ("params", "peak_device_bytes", "peak_reserved_bytes", "estimate_over_peak", "peak_rss_bytes",
            "step_s", "tokens_per_s", "timings", "host_syncs_per_step", "copy_overlap", "native_kernel")
    print(json.dumps({k: result.get(k) for k in keys}), flush=True)


def _try_layers(args, layers: int, budget_s: float) -> dict:
    """One try of section (d) in its own process (an out-of-memory must not end the search)."""
    start = time.monotonic()
    if args.tiny:
        import contextlib
        import io
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            largest_body(args, layers)
        return {"layers": layers, "ok": True, "wall_s": time.monotonic() - start,
                **json.loads(buf.getvalue().splitlines()[-1])}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_largest_body", str(layers), "--device", args.device]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_child_env(), timeout=budget_s)
    except subprocess.TimeoutExpired:
        return {"layers": layers, "ok": False, "error": f"timed out after {budget_s:.0f} s",
                "wall_s": time.monotonic() - start}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return {"layers": layers, "ok": True, "wall_s": time.monotonic() - start, **json.loads(lines[-1])}
    return {"layers": layers, "ok": False, "wall_s": time.monotonic() - start,
            "error": (proc.stdout + proc.stderr).strip().splitlines()[-3:]}


def grow(try_size, first: int, budget_s: float, most: int | None = None) -> tuple[dict | None, list[dict]]:
    """The largest size that ``try_size(size, seconds)`` passes: doubling from ``first``, then bisecting between
    the last pass and the first failure, while the budget allows the next try (predicted to take as long per
    unit of size as the last one, with half again as margin). Returns (best try or None, every try)."""
    deadline = time.monotonic() + budget_s
    best, tries, low, high, size = None, [], 0, None, first
    while size and (most is None or size <= most):
        left = deadline - time.monotonic()
        per_unit = tries[-1]["wall_s"] / tries[-1]["layers"] if tries else 0
        if left <= 5 or per_unit * size * 1.5 > left:
            break
        attempt = try_size(size, left)
        tries.append(attempt)
        if attempt["ok"]:
            best, low = attempt, size
        else:
            high = size
        size = 2 * size if high is None else (low + high) // 2
        if high is not None and (high - low <= 1 or size in (low, high)):
            break
    return best, tries


def section_largest(args) -> dict:
    budget = (TINY_LIMIT if args.tiny else LIMITS["largest"]) - 15
    best, tries = grow(lambda n, left: _try_layers(args, n, left), 1 if args.tiny else 2, budget,
                       most=4 if args.tiny else None)
    return {"attempts": tries, "largest": best, "ok": best is not None}


def ten_b_config(dpu: bool) -> dict:
    """The pinned 10B config (see `TEN_B_MICRO`), with or without the delayed update (warm-up 1)."""
    return engine_config(2, False, dpu, TEN_B_MICRO, bf16_states=True)


def run_ten_b(args, dpu: bool) -> dict:
    """The seed's 10B GPT-2 in the pinned config for `TEN_B_STEPS` timed steps on distinct batches (losses of
    every step reported), beside the step the planner's model predicts for it on an 80 GB GPU and this host."""
    import psutil
    from zero_offload.estimate import plan
    device = _device(args)
    cfg = gpt_config("gpt2-10b", args.tiny, activation_checkpointing=True)
    config = ten_b_config(dpu)
    if args.tiny:
        config = {**config, "train_micro_batch_size_per_gpu": 2}
    measured = Path(args.out) / "calibration.json"      # this machine's rates when the calibrate section ran
    predicted = plan(cfg, gpus=1, gpu_memory=80 * 10**9, host_memory=psutil.virtual_memory().total,
                     config=config, activation_checkpointing=True,
                     calibration=measured if measured.exists() else None)
    peak = measure_matmul_peak(device, args.tiny)
    result = gm.run_engine(cfg, config, device, steps=2 if args.tiny else TEN_B_STEPS, split_steps=1,
                           sharded=False)
    timing = predicted.batch.timing if predicted.batch is not None else None
    result["config"] = config
    result["predicted"] = {"fits": predicted.fits, "name": predicted.name, "reasons": predicted.reasons,
                           "constants": predicted.reasons.get("constants"),
                           "step_s": timing.step_s if timing else None,
                           "exposed_share": timing.exposed_share if timing else None,
                           "host_s": timing.host_s if timing else None}
    graph = timing.graph if timing else None
    if graph is not None:                    # the replayed timeline, beside the measured one (`gpu_report`)
        result["predicted"].update(timeline=graph.lines(), compute_s=graph.compute_s, idle_share=graph.idle_share,
                                   busy=graph.busy)
    result["tflops"] = result["flops_per_token"] * result["tokens_per_s"] / 1e12
    result["mfu"] = result["flops_per_token"] * result["tokens_per_s"] / peak
    result["matmul_peak_flops"] = peak
    losses = result["losses_all_steps"]
    result["losses_falling"] = len(losses) >= 2 and losses[-1] < losses[0]
    result["ok"] = True
    return result


def section_gpt2_10b(args) -> dict:
    return run_ten_b(args, dpu=False)


def section_gpt2_10b_dpu(args) -> dict:
    """As `section_gpt2_10b` with the delayed update on, whatever the planner says of its host memory: the run
    shows whether it fits this host (an out-of-memory here is a finding, not a crash of the script)."""
    return run_ten_b(args, dpu=True)


def two_gpu_body(args, rank: int) -> None:
    """One of two ranks (`section_two_gpus`): an NCCL-only default group made here without set_device."""
    import torch
    import torch.distributed as dist
    import zero_offload
    from zero_offload.train.model import GPT
    dist.init_process_group("nccl")
    cfg = gpt_config("gpt2", True)
    with zero_offload.init_sharded():
        model = GPT(cfg)
    engine = zero_offload.initialize(model, {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                             "zero_optimization": {"stage": 3}})
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(2):
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    print(json.dumps({"rank": rank, "device": str(engine.device), "current": torch.cuda.current_device(),
                      "losses": losses}), flush=True)
    dist.destroy_process_group()


def section_two_gpus(args) -> dict:
    import torch
    count = torch.cuda.device_count() if args.device == "cuda" else 0
    if count < 2:
        return {"ok": True, "skipped": f"needs 2 GPUs, this machine has {count}: the NCCL-only init_sharded and "
                                       f"LOCAL_RANK binding were not run here"}
    procs = []
    for rank in range(2):
        env = dict(_child_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT="29533")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_two_gpu_rank", str(rank), "--device", "cuda"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=LIMITS["two_gpus"] - 20)[0] for p in procs]
    ranks = [json.loads([ln for ln in o.splitlines() if ln.startswith("{")][-1]) if p.returncode == 0 else
             {"error": o.strip().splitlines()[-5:]} for p, o in zip(procs, outs)]
    ok = all("device" in r for r in ranks) and [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
    return {"ranks": ranks, "ok": ok}


BODIES = {"calibrate": section_calibrate, "cuda_tests": section_cuda_tests, "sanitizer": section_sanitizer,
          "gpt2": section_gpt2, "gpt2_compiled": section_gpt2_compiled,
          "largest": section_largest, "gpt2_10b": section_gpt2_10b,
          "gpt2_10b_dpu": section_gpt2_10b_dpu, "two_gpus": section_two_gpus, "gpt2_xl": section_gpt2_xl,
          "largest_planned": lambda args: section_largest_planned(args, measure_matmul_peak),
          "muon": lambda args: section_muon(args, gpt_config, _device(args)),
          "llama_trainer": lambda args: section_llama_trainer(args, measure_matmul_peak),
          "long_seq": section_long_seq}


# -- the driver -----------------------------------------------------------------------------------------------
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_validate_out"), help="directory for the reports")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke run of every section")
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated sections (default {','.join(DEFAULT_SECTIONS)}; "
                             f"all: {','.join(SECTIONS)})")
    parser.add_argument("--_section", help=argparse.SUPPRESS)
    parser.add_argument("--_sanitize_body", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_largest_body", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_two_gpu_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._two_gpu_rank is not None:
        two_gpu_body(args, args._two_gpu_rank)
        return 0
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
    import torch
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
        # after every section: a call cut short still brings back what ran
        (args.out / "gpu_validate.json").write_text(json.dumps(report, indent=1, default=str))
        (args.out / "gpu_validate.md").write_text(markdown(report))
    print(f"wrote {args.out / 'gpu_validate.json'} and {args.out / 'gpu_validate.md'}")
    return 0 if all(s.get("ok") for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
