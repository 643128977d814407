"""NVMe offload, measured side by side in one run (ZeRO-Infinity's I/O layer and host step).

1. The disk's sequential bandwidth with O_DIRECT (``dd oflag=direct`` / ``iflag=direct``, 1 MiB blocks).
2. Our `Swapper` writing and reading the same number of bytes through a pool of aligned buffers.
3. DeepSpeed's aio handle (``deepspeed.ops.aio``, DS_ACCELERATOR=cpu; needs libaio-dev) doing the same,
   or the reason it could not run.
4. The host step with the optimizer states on NVMe (`NvmeAdam`) for one partition of ``--adam-numel``
   elements, against the I/O lower bound: bytes read / read bandwidth + bytes written / write bandwidth.

    python benchmarks/bench_nvme.py --dir /work/nvme_scratch --size-gb 2 --adam-numel 500000000

Prints one JSON object (also written to ``--out``). All files are removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from zero_offload.nvme import AlignedBuffer, Swapper
from zero_offload.nvme.adam import NvmeAdam
from zero_offload.offload.copies import CopyEngine
from zero_offload.optim.fused_adam import fused_adam_step

CHUNK = 64 << 20   # bytes per request: a sub-group's state of ~5M elements


def dd_bandwidth(path: Path, nbytes: int) -> dict:
    count = nbytes >> 20
    out = {}
    for op, args in (("write", [f"if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"]),
                     ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):
        r = subprocess.run(["dd", "bs=1M", f"count={count}", *args], capture_output=True, text=True)
        m = re.search(r"copied, ([0-9.]+) s", r.stderr)
        if r.returncode != 0 or not m:
            raise RuntimeError(f"dd {op} failed: {r.stderr.strip()}")
        out[op] = (count << 20) / float(m.group(1))
    path.unlink()
    return out


def swapper_bandwidth(directory: Path, nbytes: int, threads: int, block_size: int, buffers: int) -> dict:
    s = Swapper(directory / "swapper", block_size=block_size, thread_count=threads)
    s.open("f", nbytes)
    pool = [AlignedBuffer(CHUNK) for _ in range(buffers)]
    for b in pool:
        b.raw.random_(0, 255)
    out = {"direct": s.files["f"].direct}
    for op in ("write", "read"):
        t0 = time.perf_counter()
        inflight = [None] * buffers
        for k, off in enumerate(range(0, nbytes, CHUNK)):
            slot = k % buffers
            s.wait(inflight[slot])
            n = min(CHUNK, nbytes - off)
            fn = s.write if op == "write" else s.read
            inflight[slot] = fn("f", pool[slot].raw[:n], off)
        s.flush()
        if op == "write":
            os.fsync(s.files["f"].fd)
        out[op] = nbytes / (time.perf_counter() - t0)
    s.close()
    return out


def deepspeed_aio_bandwidth(directory: Path, nbytes: int, threads: int, block_size: int) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return {"error": "AsyncIOBuilder is not compatible here (libaio-dev missing?)"}
        aio = builder.load(verbose=False)
    except Exception as e:   # report, never fail the run: DeepSpeed is only a peer here
        return {"error": f"{type(e).__name__}: {e}"}
    h = aio.aio_handle(block_size, 8, False, True, threads)
    path = str(directory / "ds_aio.bin")
    buf = h.new_cpu_locked_tensor(CHUNK, torch.empty(0, dtype=torch.uint8))
    buf.random_(0, 255)
    out = {}
    for op in ("write", "read"):
        t0 = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            n = min(CHUNK, nbytes - off)
            if op == "write":
                h.async_pwrite(buf[:n], path, off)
            else:
                h.async_pread(buf[:n], path, off)
            h.wait()
        if op == "write":
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        out[op] = nbytes / (time.perf_counter() - t0)
    h.free_cpu_locked_tensor(buf)
    os.unlink(path)
    return out


def host_step(directory: Path, numel: int, sub_group: int, threads: int, block_size: int, disk: dict) -> dict:
    part = torch.zeros(numel, dtype=torch.bfloat16)
    grad = torch.empty(numel, dtype=torch.bfloat16).normal_()
    hp = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "adamw_mode": True,
          "bias_correction": True}
    t0 = time.perf_counter()
    adam = NvmeAdam([part], [hp], CopyEngine(torch.device("cpu")), directory / "adam", sub_group, 3,
                    pipeline_read=True, pipeline_write=True, block_size=block_size, thread_count=threads)
    init_s = time.perf_counter() - t0
    adam.step([grad], 1.0)             # step 1 reads sparse moments: not the steady state
    out = {"init_s": init_s, "step_s": []}
    for _ in range(2):
        adam.timings = dict.fromkeys(adam.timings, 0.0)
        t0 = time.perf_counter()
        adam.step([grad], 1.0)
        out["step_s"].append(time.perf_counter() - t0)
        out["split"] = dict(adam.timings)
    moved = 3 * 4 * numel
    out["bytes_read"] = out["bytes_written"] = moved
    out["io_lower_bound_s"] = moved / disk["read"] + moved / disk["write"]
    out["ratio_to_bound"] = min(out["step_s"]) / out["io_lower_bound_s"]
    # The Adam compute alone, in memory, on one sub-group, scaled: what the pipeline must hide.
    n = min(sub_group, numel)
    m, v, w = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    t0 = time.perf_counter()
    fused_adam_step(w, grad[:n], m, v, step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                    out=part[:n])
    out["adam_compute_s"] = (time.perf_counter() - t0) * numel / n
    adam.close()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work/nvme_scratch", help="scratch directory on the disk to measure")
    ap.add_argument("--size-gb", type=float, default=2.0, help="bytes written and read per measurement (GB)")
    ap.add_argument("--threads", type=int, default=2, help="I/O threads (aio intra_op_parallelism)")
    ap.add_argument("--block-size", type=int, default=1 << 20, help="aio block_size in bytes")
    ap.add_argument("--buffers", type=int, default=4, help="requests in flight (buffer_count)")
    ap.add_argument("--adam-numel", type=int, default=500_000_000, help="partition elements for the host step")
    ap.add_argument("--sub-group", type=int, default=50_000_000, help="sub_group_size for the host step")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's aio (its JIT build takes minutes)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    directory = Path(args.dir) / "bench_nvme"
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = max(CHUNK, int(args.size_gb * 1e9) // CHUNK * CHUNK)
    res = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "bytes": nbytes, "threads": args.threads}
    res["dd"] = dd_bandwidth(directory / "dd.bin", nbytes)
    res["swapper"] = swapper_bandwidth(directory, nbytes, args.threads, args.block_size, args.buffers)
    res["deepspeed_aio"] = ({"error": "skipped (--no-deepspeed)"} if args.no_deepspeed
                            else deepspeed_aio_bandwidth(directory, nbytes, args.threads, args.block_size))
    for op in ("write", "read"):
        res["swapper"][f"{op}_vs_dd"] = res["swapper"][op] / res["dd"][op]
        if op in res["deepspeed_aio"]:
            res["swapper"][f"{op}_vs_deepspeed"] = res["swapper"][op] / res["deepspeed_aio"][op]
    res["host_step"] = host_step(directory, args.adam_numel, args.sub_group, args.threads, args.block_size,
                                 res["dd"])
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    for p in sorted(directory.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    directory.rmdir()
    return res


if __name__ == "__main__":
    sys.exit(main() and 0)
