"""Measured hardware constants for the step model: ``zero-offload calibrate --out FILE``.

The planner's step model (`zero_offload.estimate.throughput`) needs six rates. Built in, they are assumptions
(docs/estimate.md); this module measures them on the machine at hand and writes them as JSON:

- ``matmul_bf16_flops``: FLOP/s of a square bf16 matmul (8192, 2 x n^3 FLOPs each) on the accelerator, the
  device's peak as a training step can reach it (MFU's denominator);
- ``h2d_bytes_per_s`` and ``d2h_bytes_per_s``: bytes/s of one copy of 512 MiB between pinned host memory and the
  device, each direction, on a side stream (as the engine's copies run);
- ``host_adam_params_per_s``: parameters/s of the fused host Adam kernel (`zero_offload.optim.fused_adam`) at
  the planner's layout (fp32 master and moments, bf16 gradient and bf16 output: 28 bytes per parameter), with
  the thread count a delayed host step gets (``offload_optimizer.cpuadam_cores_perc`` of the cores,
  `zero_offload.offload.host_cores`) and with every core (the synchronous step); the bf16-moment layout
  (20 bytes per parameter) beside it;
- ``host_load_share``: the share of that rate the kernel keeps beside training (at most 1): the median over pairs
  of runs timed back to back, alone and under `training_load` (a thread converting 16-bit pieces to fp32, as the
  staging thread does, and on a GPU pinned copies each way at once, the gradients down and the parameters up).
  Inside a GPU step the host step ran 20-40 % slower than its rate alone; the step model charges the host step at
  ``host_adam x host_load_share``. Without a GPU the copies cannot run, and the share measured without them (in
  ``measured``) is not written as the constant: the step model keeps its built-in one;
- ``nvme_read_bytes_per_s``, ``nvme_write_bytes_per_s`` and ``nvme_duplex_bytes_per_s`` (with ``--nvme-path``):
  bytes/s of sequential writes, of reads, and of both at once (a write and a read in flight together, as a
  pipelined sub-group pass keeps them), of a 1 GiB swap file in that directory through the engine's own swapper
  (`zero_offload.nvme.swapper`: O_DIRECT where the filesystem takes it, aio's default 1 MiB pieces, requests of
  256 MiB each waited for, as a sub-group pass issues them): the rates of one rank's swap-file I/O.

Without an accelerator only the host side is measured; the device figures are ``None``. Each rate is the best of
a few repetitions after a warm-up (the machine's sustainable rate, not its average under other load). The step
model turns them into its figures (`zero_offload.estimate.throughput.calibrated`).

File format (``version`` 1)::

    {"version": 1, "created": "<ISO time>", "machine": {"host_cores": 16, "device": "NVIDIA H100 ..."},
     "constants": {"matmul_bf16_flops": ..., "h2d_bytes_per_s": ..., "d2h_bytes_per_s": ...,
                   "host_adam_params_per_s": ..., "host_adam_threads": 12, "host_load_share": 0.8,
                   "nvme_read_bytes_per_s": ..., "nvme_write_bytes_per_s": ..., "nvme_duplex_bytes_per_s": ...},
     "measured": {...every figure, per thread count and layout...}}
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import threading
import time
from pathlib import Path

__all__ = ["measure", "measure_nvme", "write", "load", "default_path", "DEFAULT_PATH", "CalibrationError",
           "training_load", "measure_host_adam", "measure_host_adam_beside_training"]

VERSION = 1
# Seconds a `training_load` worker may take to allocate its buffers and do its first pass.
LOAD_START_S = 120
ENV = "ZERO_OFFLOAD_CALIBRATION"
# Where `zero_offload.plan` and `zero-offload estimate` look when no file is named (docs/estimate.md).
DEFAULT_PATH = Path.home() / ".cache" / "zero_offload" / "calibration.json"


def default_path() -> Path:
    """``$ZERO_OFFLOAD_CALIBRATION`` when set, else `DEFAULT_PATH`."""
    return Path(os.environ.get(ENV) or DEFAULT_PATH)


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and the key at fault."""


def _best_rate(work: float, run, reps: int, sync=lambda: None) -> float:
    """``work`` per second of the fastest of ``reps`` timed calls of ``run`` (after one warm-up call)."""
    run()
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return work / best


def measure_matmul(device, n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of an ``n x n`` bf16 matmul on ``device`` (a CUDA device)."""
    import torch
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def run():
        for _ in range(5):
            a @ b
    return _best_rate(5 * 2 * n ** 3, run, reps, lambda: torch.cuda.synchronize(device))


def measure_copies(device, nbytes: int = 512 << 20, reps: int = 8) -> dict:
    """Bytes/s of pinned host -> device and device -> host copies of ``nbytes`` on a side stream."""
    import torch
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)

    def copy(dst, src):
        def run():
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
        return run
    return {"h2d_bytes_per_s": _best_rate(nbytes, copy(dev, host), reps),
            "d2h_bytes_per_s": _best_rate(nbytes, copy(host, dev), reps)}


def _host_adam_run(threads: int, moments: str, n: int):
    """One fused host Adam step over ``n`` elements per call (bf16 gradient and output, fp32 master)."""
    import torch
    from zero_offload.optim.fused_adam import fused_adam_step
    state = torch.float32 if moments == "fp32" else torch.bfloat16
    master = torch.randn(n)
    grad = torch.randn(n, dtype=torch.bfloat16)
    m, v = torch.zeros(n, dtype=state), torch.zeros(n, dtype=state)
    out = torch.empty(n, dtype=torch.bfloat16)
    step = iter(range(1, 10**6))

    def run():
        fused_adam_step(master, grad, m, v, step=next(step), lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.01, out=out, num_threads=threads)
    return run


def measure_host_adam(threads: int, moments: str = "fp32", n: int = 1 << 26, reps: int = 5) -> float:
    """Parameters/s of the fused host Adam kernel over ``n`` elements (bf16 gradient and output) at ``threads``
    OpenMP threads, with fp32 or bf16 moments."""
    return _best_rate(n, _host_adam_run(threads, moments, n), reps)


@contextlib.contextmanager
def training_load(cuda_device=None, elems: int = 1 << 24):
    """What runs beside the host step in training, on threads of its own until the block ends: the staging
    thread's conversions of 16-bit gradient pieces into fp32 (``elems`` fp16 -> fp32 per pass, one core, numpy
    so that no torch intra-op pool competes for the step's cores) and, with ``cuda_device``, pinned copies of
    ``4 x elems`` bytes each way at once on two side streams (the gradients coming down, the parameters going
    up: the memory traffic that DMA adds). The block starts once every worker has done one pass (its buffers
    touched, its streams warm), so what it times runs under the load, not its start.

    Raises:
        Whatever a worker raised (a pinned allocation refused, a CUDA error): at the start when it set up, or
        at the end of the block when it failed while the block ran (a load that stopped must not pass for one).
        RuntimeError: a worker not started within `LOAD_START_S` seconds.
    """
    import numpy as np
    stop = threading.Event()
    started = threading.Semaphore(0)          # released by each worker after its first pass: the load is on

    def convert():
        src, dst = np.ones(elems, np.float16), np.empty(elems, np.float32)
        np.copyto(dst, src)
        started.release()
        while not stop.is_set():
            np.copyto(dst, src)

    def copy():
        import torch
        host_in = torch.empty(4 * elems, dtype=torch.uint8, pin_memory=True)
        host_out = torch.empty_like(host_in, pin_memory=True)
        dev_in, dev_out = (torch.empty(4 * elems, dtype=torch.uint8, device=cuda_device) for _ in range(2))
        up, down = torch.cuda.Stream(cuda_device), torch.cuda.Stream(cuda_device)

        def both_ways():
            with torch.cuda.stream(up):
                dev_in.copy_(host_in, non_blocking=True)
            with torch.cuda.stream(down):
                host_out.copy_(dev_out, non_blocking=True)
            up.synchronize()
            down.synchronize()
        both_ways()
        started.release()
        while not stop.is_set():
            both_ways()
    errors: list[BaseException] = []

    def guarded(body):
        def run():
            try:
                body()
            except BaseException as e:       # handed to the caller, who may be waiting for this worker's start
                errors.append(e)
                started.release()
        return run
    workers = [threading.Thread(target=guarded(f), daemon=True, name=f"calibrate-load-{f.__name__}")
               for f in ([convert, copy] if cuda_device is not None else [convert])]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            if not started.acquire(timeout=LOAD_START_S):
                raise RuntimeError(f"calibrate: the training load did not start within {LOAD_START_S} s")
        if errors:
            raise errors[0]
        yield
    finally:
        stop.set()
        for w in workers:
            w.join()
    if errors:
        raise errors[0]


def measure_host_adam_beside_training(threads: int, n: int = 1 << 26, reps: int = 7,
                                      cuda_device=None) -> tuple[float, float, float]:
    """(alone, beside training, share): parameters/s of the fused host Adam kernel (fp32 moments) at ``threads``
    threads, by itself and under `training_load` (each the best of ``reps``), and the median over the ``reps``
    pairs of the two timed back to back of the loaded rate over the one alone: a pair sees one state of the
    machine, whose memory bandwidth drifts between pairs."""
    import statistics
    run = _host_adam_run(threads, "fp32", n)
    run()

    def timed() -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    pairs = []
    for _ in range(reps):
        alone = timed()
        with training_load(cuda_device):
            pairs.append((alone, timed()))
    return (n / min(a for a, _ in pairs), n / min(b for _, b in pairs),
            statistics.median(a / b for a, b in pairs))


def measure_nvme(path, nbytes: int = 1 << 30, request: int = 256 << 20, reps: int = 3) -> dict:
    """Bytes/s of sequential writes, of reads, and of both at once (the two halves of the file, a request of
    each in flight together), of an ``nbytes`` swap file under ``path`` through the engine's swapper, ``request``
    bytes per request (each waited for, as a sub-group pass does), best of ``reps``; the file is removed after.

    Raises:
        NvmeIOError: a failed read or write (naming the file).
    """
    from zero_offload.nvme.buffers import AlignedBuffer
    from zero_offload.nvme.swapper import Swapper
    swapper = Swapper(Path(path) / "zero_offload_calibrate", queue_depth=8)
    try:
        buf, other = AlignedBuffer(min(request, nbytes)).raw, AlignedBuffer(min(request, nbytes)).raw
        swapper.open("probe.swp", nbytes)
        rates = {}
        for key, move in (("nvme_write_bytes_per_s", swapper.write), ("nvme_read_bytes_per_s", swapper.read)):
            def run(move=move):
                for offset in range(0, nbytes, buf.numel()):
                    swapper.wait(move("probe.swp", buf[:min(buf.numel(), nbytes - offset)], offset))
            rates[key] = _best_rate(nbytes, run, reps)
        half = nbytes // 2 // buf.numel() * buf.numel()

        def both():              # a pipelined pass: a write behind in flight beside a read ahead
            for offset in range(0, half, buf.numel()):
                pending = [swapper.write("probe.swp", buf, offset), swapper.read("probe.swp", other, half + offset)]
                for p in pending:
                    swapper.wait(p)
        rates["nvme_duplex_bytes_per_s"] = _best_rate(2 * half, both, reps)
        return rates
    finally:
        swapper.close()


def measure(device: str = "auto", cores_perc: float = 0.8, host_elems: int = 1 << 26, nvme_path=None) -> dict:
    """Every constant this machine allows (see the module docstring). ``device``: "auto" (CUDA when present),
    "cuda" or "cpu" (host side only); ``cores_perc``: the share of cores a delayed host step gets; ``nvme_path``:
    a swap directory to measure (None: the NVMe rates are not measured).

    Raises:
        ValueError: ``device="cuda"`` where no CUDA device is visible.
        NvmeIOError: a failed read or write under ``nvme_path``.
    """
    import torch
    from zero_offload.offload.host_cores import available_cores, host_step_cores
    from zero_offload.optim.fused_adam import native_available
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("calibrate --device cuda: no CUDA device is visible")
    cores = available_cores()
    step_threads = len(host_step_cores(cores_perc, cores))
    measured: dict = {"host_adam": {}, "native_kernel": native_available()}
    for threads in sorted({step_threads, len(cores)}):
        for moments in ("fp32", "bf16"):
            measured["host_adam"][f"{moments}_moments_{threads}_threads"] = measure_host_adam(
                threads, moments, host_elems)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    alone, loaded, share = measure_host_adam_beside_training(step_threads, host_elems, cuda_device=dev)
    measured["host_adam"][f"fp32_moments_{step_threads}_threads_alone_interleaved"] = alone
    measured["host_adam"][f"fp32_moments_{step_threads}_threads_beside_training"] = loaded
    measured["host_load_share"] = share
    # without the copies (no GPU) the measured share is not the one in training: the built-in stays
    constants = {"host_adam_params_per_s": measured["host_adam"][f"fp32_moments_{step_threads}_threads"],
                 "host_adam_threads": step_threads, "host_load_share": min(1.0, share) if cuda else None,
                 "matmul_bf16_flops": None, "h2d_bytes_per_s": None,
                 "d2h_bytes_per_s": None, "nvme_read_bytes_per_s": None, "nvme_write_bytes_per_s": None,
                 "nvme_duplex_bytes_per_s": None}
    if nvme_path is not None:
        constants.update(measure_nvme(nvme_path))
    name = platform.processor() or platform.machine()
    if cuda:
        name = torch.cuda.get_device_name(dev)
        constants["matmul_bf16_flops"] = measure_matmul(dev)
        constants.update(measure_copies(dev))
        torch.cuda.empty_cache()
    return {"version": VERSION, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "machine": {"host_cores": len(cores), "device": name, "torch": torch.__version__,
                        "cores_perc": cores_perc},
            "constants": constants, "measured": measured}


def write(result: dict, path) -> Path:
    """Write `measure`'s result to ``path`` (its folder made), atomically (a rename over the old file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return path


def load(path) -> dict:
    """The ``constants`` of a calibration file, checked: every rate a number > 0 or None.

    Raises:
        CalibrationError: the file is missing, not JSON, of another version, or has a rate that is not a
            positive number, or a ``host_load_share`` above 1 (the message names the file and the key).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CalibrationError(f"calibration file {path} does not exist (write one: zero-offload calibrate "
                               f"--out {path})") from None
    except json.JSONDecodeError as e:
        raise CalibrationError(f"calibration file {path} is not JSON: {e}") from None
    version = data.get("version") if isinstance(data, dict) else None
    if version != VERSION:
        raise CalibrationError(f"calibration file {path}: version {version!r}, expected {VERSION}")
    constants = data.get("constants")
    if not isinstance(constants, dict):
        raise CalibrationError(f"calibration file {path}: no 'constants' object")
    for key in ("matmul_bf16_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_adam_params_per_s",
                "host_load_share", "nvme_read_bytes_per_s", "nvme_write_bytes_per_s", "nvme_duplex_bytes_per_s"):
        value = constants.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise CalibrationError(f"calibration file {path}: constants.{key} must be a number > 0 or null, "
                                   f"got {value!r}")
    share = constants.get("host_load_share")
    if share is not None and share > 1:
        raise CalibrationError(f"calibration file {path}: constants.host_load_share must be at most 1 (a share of "
                               f"the kernel's rate alone), got {share!r}")
    return dict(constants, source=str(path))

