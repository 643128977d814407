"""What `gpu_validate.py` measures of one training run: tokens/s, peak device memory against `estimate_memory`,
`engine.timings` (device time from CUDA events), host syncs per step and the share of copy time that overlaps
compute kernels (both from a `torch.profiler` trace of two steps, so that the copies up queued at the end of the
first overlap the second's forward inside the window), and whether the native host kernel ran. Every
engine is freed (``del``, ``gc.collect()``, ``torch.cuda.empty_cache()``) before the caller measures the next.

Definitions:
- host syncs per step: ``cudaStreamSynchronize`` + ``cudaDeviceSynchronize`` calls in the profiled step (CUDA
  runtime events of the trace, less the one synchronisation that closes the trace; ``cudaEventSynchronize``
  reported apart); 0 on the CPU, where there are none;
- peak device memory: ``max_memory_allocated``, and ``max_memory_reserved`` beside it (blocks the allocator holds
  for later reuse, as a block freed with ``record_stream`` is until its stream passes it);
- peak RSS: this run's, sampled (`RssPeak`), not the process's lifetime peak;
- copy overlap: the time of ``Memcpy DtoH``/``HtoD`` intervals that intersects the union of kernel intervals,
  over the copies' total time; None where the trace has no copy (the CPU).
"""
from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

__all__ = ["free", "trace_figures", "copy_compute_overlap", "profile_steps", "run_engine", "run_plain", "batches",
           "build_model", "native_state", "out_of_memory", "RssPeak"]

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize")


def _torch():
    import torch
    return torch


def free() -> None:
    """Drop what the last run left: unreachable engines (cycles), then the allocator's cached blocks."""
    gc.collect()
    torch = _torch()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def native_state() -> dict:
    """Whether the host Adam kernel is the native one in this process, and its instruction set."""
    from zero_offload.optim.fused_adam import active_isa, native_available
    return {"native_kernel": native_available(), "isa": active_isa() if native_available() else None}


def _merge(intervals):
    out = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _union_s(intervals) -> float:
    return sum(hi - lo for lo, hi in _merge(intervals)) / 1e6


def _overlap(spans, kernels) -> float:
    """Microseconds of ``spans`` (sorted or not) inside the merged ``kernels`` intervals."""
    hidden = 0.0
    for lo, hi in spans:
        for klo, khi in kernels:
            if khi <= lo:
                continue
            if klo >= hi:
                break
            hidden += min(hi, khi) - max(lo, klo)
    return hidden


def copy_compute_overlap(events: list[dict]) -> tuple[float | None, float]:
    """(overlapping share, copy seconds) of the memcpy events of a chrome trace's ``traceEvents`` against its
    kernel events (``ts``/``dur`` in microseconds): the share is None when there is no copy."""
    figures = copy_directions(events)
    total = sum(d["s"] for d in figures.values())
    if total <= 0:
        return None, 0.0
    return sum(d["s"] * (d["overlap"] or 0.0) for d in figures.values()) / total, total


def copy_directions(events: list[dict]) -> dict:
    """Per direction (``h2d``, ``d2h``) of the trace's memcpy events: seconds, bytes, achieved bytes/s while
    copying, and the share of the copy time that overlaps kernels (None without copies)."""
    kernels = _merge((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    out = {}
    for key, tag in (("h2d", "HtoD"), ("d2h", "DtoH")):
        mine = [e for e in events if e.get("cat") == "gpu_memcpy" and tag in e.get("name", "")]
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in mine]
        us = sum(hi - lo for lo, hi in spans)
        nbytes = sum(int((e.get("args") or {}).get("bytes", 0)) for e in mine)
        out[key] = {"s": us / 1e6, "bytes": nbytes, "count": len(mine),
                    "bytes_per_s": nbytes / (us / 1e6) if us > 0 else None,
                    "overlap": _overlap(spans, kernels) / us if us > 0 else None}
    return out


def trace_figures(events: list[dict], steps: int, own_syncs: int = 0, wall_s: float | None = None) -> dict:
    """Host syncs per step (count and summed seconds), copies per direction, device-idle share and the copy
    overlap of a chrome trace (see the module docstring); ``own_syncs``: synchronisations the measurement itself
    made inside the trace (not counted); ``wall_s``: the traced steps' wall-clock seconds (for the idle share)."""
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    syncs = [e for e in runtime if e.get("name", "") in SYNC_NAMES]
    event_syncs = [e for e in runtime if e.get("name", "") == "cudaEventSynchronize"]
    steps = max(steps, 1)
    # The closing synchronisation is the trace's last one: its time is the measurement's, not the step's.
    own = sorted(syncs, key=lambda e: e["ts"])[-own_syncs:] if own_syncs else []
    sync_s = (sum(e.get("dur", 0) for e in syncs) - sum(e.get("dur", 0) for e in own)) / 1e6
    share, copy_s = copy_compute_overlap(events)
    kernel_s = _union_s((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    return {"host_syncs_per_step": max(0, len(syncs) - own_syncs) / steps, "host_sync_s_per_step": sync_s / steps,
            "event_syncs_per_step": len(event_syncs) / steps,
            "event_sync_s_per_step": sum(e.get("dur", 0) for e in event_syncs) / 1e6 / steps,
            "copy_overlap": share, "copy_s_per_step": copy_s / steps,
            "copies": {k: {**v, "s": v["s"] / steps, "bytes": v["bytes"] / steps}
                       for k, v in copy_directions(events).items()},
            "kernel_s_per_step": kernel_s / steps,
            "device_idle_share": (1 - kernel_s / wall_s) if wall_s and kernel_s else None}


def profile_steps(one_step, device, steps: int = 1) -> dict:
    """Run ``one_step()`` ``steps`` times under `torch.profiler` (CPU and, on CUDA, CUDA activity) and return
    `trace_figures` of its trace."""
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            one_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)     # so the trace holds the step's kernels: not one of its syncs
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return {**trace_figures(events, steps, own_syncs=int(device.type == "cuda"), wall_s=wall),
            "profiled_step_s": wall / steps}


def _sync(device):
    torch = _torch()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(one_step, device, steps: int, warmup: int = 2) -> float:
    """Seconds for ``steps`` calls of ``one_step`` after ``warmup`` untimed ones, synchronised at both ends."""
    for _ in range(warmup):
        one_step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    _sync(device)
    return time.perf_counter() - start


def _reset_peak(device) -> None:
    torch = _torch()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> int:
    torch = _torch()
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _peak_reserved(device) -> int:
    """The allocator's peak reserved bytes: blocks held for reuse count here, not in ``max_memory_allocated``."""
    torch = _torch()
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0


class RssPeak:
    """The largest resident set of this process while it runs (sampled from /proc/self/statm every 20 ms on a
    thread): the peak of one run, where ``ru_maxrss`` would give the process's peak over every run before it."""

    def __init__(self, interval_s: float = 0.02):
        import os
        import threading
        self.page, self.interval_s, self.peak = os.sysconf("SC_PAGE_SIZE"), interval_s, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self._rss())
            if self.done.wait(self.interval_s):
                return

    def stop(self) -> int:
        """Stop sampling; the peak in bytes."""
        self.done.set()
        self.thread.join()
        return max(self.peak, self._rss())


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


def batches(vocab: int, micro: int, seq: int, device, n: int):
    """``n`` distinct (input, target) micro-batches of ``micro`` x ``seq`` random tokens on ``device``."""
    torch = _torch()
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        data = torch.randint(0, vocab, (micro, seq + 1), generator=g)
        out.append((data[:, :-1].to(device), data[:, 1:].to(device)))
    return out


def run_engine(cfg_model, config: dict, device, steps: int, split_steps: int, sharded: bool,
               profile: bool = True, distinct: int = 64, compile_backend: str | None = None) -> dict:
    """Train with the engine: tokens/s over ``steps`` timed steps (after 2 warm-up steps), `engine.timings`
    averaged over ``split_steps`` more, one profiled step, and the memory figures; every micro-step gets its own
    batch (up to ``distinct`` of them); the engine is freed. ``compile_backend``: ``engine.compile(backend)``
    first (the warm-up steps compile)."""
    rss = RssPeak()
    try:
        return _run_engine(cfg_model, config, device, steps, split_steps, sharded, profile, rss, distinct,
                           compile_backend)
    finally:
        rss.stop()          # also when the run fails (out of memory: the caller retries smaller)


def _run_engine(cfg_model, config: dict, device, steps: int, split_steps: int, sharded: bool, profile: bool,
                rss: RssPeak, distinct: int, compile_backend: str | None = None) -> dict:
    import zero_offload
    from zero_offload.estimate import estimate_memory
    from zero_offload.train.model import flops_per_token
    torch = _torch()
    _reset_peak(device)
    model = build_model(cfg_model, device, torch.bfloat16, sharded)
    engine = zero_offload.initialize(model, config)
    if compile_backend is not None:
        engine.compile(backend=compile_backend)
    micro, gas, seq = engine.train_micro_batch_size_per_gpu, engine.gradient_accumulation_steps, cfg_model.block_size
    total = (2 + steps + split_steps + 2 * int(profile)) * gas
    data = batches(cfg_model.vocab_size, micro, seq, device, min(total, distinct))   # one batch per micro-step
    losses, turn = [], iter(range(10**9))

    def one_step():
        for _ in range(gas):
            x, y = data[next(turn) % len(data)]
            _, loss = engine(x, y)
            engine.backward(loss)
        engine.step()
        losses.append(loss)

    elapsed = timed_steps(one_step, device, steps)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    timings: dict = {}
    for _ in range(split_steps):
        one_step()
        for k, v in engine.timings.items():
            timings[k] = timings.get(k, 0.0) + v / split_steps
    # two steps: the copies up queued at the end of the first overlap the second's forward inside the window
    traced = profile_steps(one_step, device, steps=2) if profile else {}
    breakdown = {k: v["bytes"] for k, v in engine.memory_breakdown().items()}
    host_state = sum(v["bytes"] for v in engine.memory_breakdown().values() if v["side"] == "host")
    estimate = estimate_memory(cfg_model, config, micro_batch=micro, seq_len=seq,
                               accelerator=device.type == "cuda").device_bytes
    n_params = sum(u.numel for u in engine.zero.units) if sharded else sum(p.numel() for p in model.parameters())
    peak = _peak(device)
    result = {"tokens_per_s": micro * gas * seq * steps / elapsed, "step_s": elapsed / steps,
              "losses": [float(x) for x in losses[-steps:]], "losses_all_steps": [float(x) for x in losses],
              "host_threads": _thread_report(), "micro_batch": micro, "gradient_accumulation": gas,
              "peak_device_bytes": peak, "resident_device_bytes": resident, "estimate_device_bytes": estimate,
              "estimate_over_peak": estimate / peak if peak else None, "peak_reserved_bytes": _peak_reserved(device),
              "peak_rss_bytes": rss.stop(),
              "host_state_bytes": host_state, "params": n_params,
              "host_bytes_per_param": host_state / max(n_params, 1),
              "flops_per_token": flops_per_token(cfg_model, seq), "timings": timings,
              "stats": engine.stats.as_dict(), "memory_breakdown": breakdown, **traced, **native_state()}
    engine.flush_delayed_update()
    del engine, model, data, losses
    free()
    return result


def _thread_report() -> dict:
    """This process's cores, the torch thread count and the host-step cores the default split gives."""
    torch = _torch()
    from zero_offload.offload.host_cores import available_cores, host_step_cores
    cores = available_cores()
    return {"available_cores": len(cores), "torch_threads": torch.get_num_threads(),
            "host_step_cores_default": len(host_step_cores(0.8, cores))}


def run_plain(cfg_model, device, micro: int, steps: int, profile: bool = True,
              compile_backend: str | None = None, optimizers=None) -> dict:
    """Plain torch: fp32 weights, bf16 autocast, torch.optim.AdamW(fused=True) on the device; freed after.
    ``compile_backend``: the model compiled in place first. ``optimizers(model)``: a list of optimizers instead."""
    rss = RssPeak()
    try:
        return _run_plain(cfg_model, device, micro, steps, profile, rss, compile_backend, optimizers)
    finally:
        rss.stop()


def _run_plain(cfg_model, device, micro: int, steps: int, profile: bool, rss: RssPeak,
               compile_backend: str | None = None, optimizers=None) -> dict:
    torch = _torch()
    from zero_offload.train.model import flops_per_token
    _reset_peak(device)
    model = build_model(cfg_model, device, torch.float32, sharded=False)
    if compile_backend is not None:
        model.compile(backend=compile_backend)
    opts = optimizers(model) if optimizers is not None else [
        torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")]
    seq = cfg_model.block_size
    data = batches(cfg_model.vocab_size, micro, seq, device, 4)
    it = iter(range(10**9))

    def one_step():
        x, y = data[next(it) % len(data)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    elapsed = timed_steps(one_step, device, steps)
    traced = profile_steps(one_step, device) if profile else {}
    result = {"tokens_per_s": micro * seq * steps / elapsed, "step_s": elapsed / steps, "micro_batch": micro,
              "peak_device_bytes": _peak(device), "peak_reserved_bytes": _peak_reserved(device),
              "peak_rss_bytes": rss.stop(),
              "params": sum(p.numel() for p in model.parameters()), "flops_per_token": flops_per_token(cfg_model, seq),
              **traced}
    del model, opts, data
    free()
    return result


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the device (or host) running out of memory."""
    torch = _torch()
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower()
