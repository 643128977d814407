"""NVMe offload, measured side by side in one run (ZeRO-Infinity's I/O layer and host step).

1. The disk's sequential bandwidth with O_DIRECT (``dd oflag=direct`` / ``iflag=direct``, 1 MiB blocks), with
   one stream (queue depth 1) and with ``--dd-streams`` at once (requests in flight, as the swapper keeps);
   the disk's best of the two is the bandwidth the bounds below use.
2. Our `Swapper` writing and reading the same number of bytes through a pool of aligned buffers.
3. DeepSpeed's aio handle (``deepspeed.ops.aio``, DS_ACCELERATOR=cpu; needs libaio-dev) doing the same,
   or the reason it could not run.
4. The host step with the optimizer states on NVMe (`NvmeAdam`) for one partition of ``--adam-numel``
   elements, against the I/O lower bound: bytes read / read bandwidth + bytes written / write bandwidth.

``--drop-caches`` (root) drops the page cache before every timed read and host step, so a buffered fallback
cannot read from memory (O_DIRECT reads bypass it anyway).

    python benchmarks/bench_nvme.py --dir /work/nvme_scratch --size-gb 2 --adam-numel 500000000

Prints one JSON object (also written to ``--out``). All files are removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from zero_offload.nvme import AlignedBuffer, Swapper
from zero_offload.hoststep.nvme_adam import NvmeAdam
from zero_offload.zero.grad_partition import ReadyGrad
from zero_offload.offload.copies import make_copies
from zero_offload.optim.fused_adam import fused_adam_step

CHUNK = 64 << 20   # bytes per request: a sub-group's state of ~5M elements
QUEUE_DEPTH = 8    # aio queue_depth (DeepSpeed's default): requests in flight per I/O thread, for both


def drop_caches(enabled: bool) -> None:
    """Drop the guest's page cache (root only), so that no read below is served from memory."""
    if enabled:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def dd_bandwidth(path: Path, nbytes: int, streams: int = 1, drop: bool = False) -> dict:
    """Sequential O_DIRECT bandwidth with ``streams`` dd processes on disjoint ranges of one file (1 MiB blocks):
    1 stream is queue depth 1; several keep several requests in flight, as the swapper's threads do."""
    count = (nbytes >> 20) // streams
    out = {}
    for op in ("write", "read"):
        if op == "read":
            drop_caches(drop)
        procs = []
        t0 = time.perf_counter()
        for k in range(streams):
            args = (["if=/dev/zero", f"of={path}", "oflag=direct", "conv=notrunc,fsync", f"seek={k * count}"]
                    if op == "write" else [f"if={path}", "of=/dev/null", "iflag=direct", f"skip={k * count}"])
            procs.append(subprocess.Popen(["dd", "bs=1M", f"count={count}", *args], stderr=subprocess.PIPE,
                                          text=True))
        for proc in procs:
            err = proc.communicate()[1]
            if proc.returncode != 0:
                raise RuntimeError(f"dd {op} failed: {err.strip()}")
        out[op] = streams * (count << 20) / (time.perf_counter() - t0)
    path.unlink()
    return out


def swapper_bandwidth(directory: Path, nbytes: int, threads: int, block_size: int, buffers: int,
                      drop: bool = False) -> dict:
    s = Swapper(directory / "swapper", block_size=block_size, thread_count=threads, queue_depth=QUEUE_DEPTH)
    s.open("f", nbytes)
    pool = [AlignedBuffer(CHUNK) for _ in range(buffers)]
    for b in pool:
        b.raw.random_(0, 255)
    out = {"direct": s.files["f"].direct}
    for op in ("write", "read"):
        if op == "read":
            drop_caches(drop)
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


def deepspeed_aio_bandwidth(directory: Path, nbytes: int, threads: int, block_size: int, buffers: int,
                            drop: bool = False) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return {"error": "AsyncIOBuilder is not compatible here (libaio-dev missing?)"}
        aio = builder.load(verbose=False)
    except Exception as e:   # report, never fail the run: DeepSpeed is only a peer here
        return {"error": f"{type(e).__name__}: {e}"}
    h = aio.aio_handle(block_size, QUEUE_DEPTH, False, True, threads)
    path = str(directory / "ds_aio.bin")
    # The same requests in flight as the swapper: ``buffers`` pinned chunks issued, then one wait.
    bufs = [h.new_cpu_locked_tensor(CHUNK, torch.empty(0, dtype=torch.uint8)) for _ in range(buffers)]
    for b in bufs:
        b.random_(0, 255)
    out = {}
    for op in ("write", "read"):
        if op == "read":
            drop_caches(drop)
        t0 = time.perf_counter()
        offsets = list(range(0, nbytes, CHUNK))
        for first in range(0, len(offsets), buffers):
            for b, off in zip(bufs, offsets[first:first + buffers]):
                n = min(CHUNK, nbytes - off)
                if op == "write":
                    h.async_pwrite(b[:n], path, off)
                else:
                    h.async_pread(b[:n], path, off)
            h.wait()
        if op == "write":
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        out[op] = nbytes / (time.perf_counter() - t0)
    for b in bufs:
        h.free_cpu_locked_tensor(b)
    os.unlink(path)
    return out


def host_step(directory: Path, numel: int, sub_group: int, threads: int, block_size: int, disk: dict,
              drop: bool = False) -> dict:
    part = torch.zeros(numel, dtype=torch.bfloat16)
    grad = torch.empty(numel, dtype=torch.bfloat16).normal_()
    hp = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "adamw_mode": True,
          "bias_correction": True}
    t0 = time.perf_counter()
    adam = NvmeAdam([part], [hp], make_copies(torch.device("cpu")), directory / "adam", sub_group, 3,
                    pipeline_read=True, pipeline_write=True, block_size=block_size, thread_count=threads,
                    queue_depth=QUEUE_DEPTH)
    init_s = time.perf_counter() - t0
    adam.step([ReadyGrad(grad)], 1.0)             # step 1 reads sparse moments: not the steady state
    out = {"init_s": init_s, "step_s": []}
    for _ in range(2):
        adam.timings = dict.fromkeys(adam.timings, 0.0)
        drop_caches(drop)
        t0 = time.perf_counter()
        adam.step([ReadyGrad(grad)], 1.0)
        out["step_s"].append(time.perf_counter() - t0)
        out["split"] = dict(adam.timings)
    moved = 3 * 4 * numel
    out["bytes_read"] = out["bytes_written"] = moved
    # The bound takes the disk at its best measured bandwidth each way (one dd stream or several in flight).
    out["io_lower_bound_s"] = moved / disk["read"] + moved / disk["write"]
    out["ratio_to_bound"] = min(out["step_s"]) / out["io_lower_bound_s"]
    # Reads of sub-group i+1 and writes of i-1 are in flight together: a disk that serves both at once (a
    # virtual disk does) bounds the step by the slower direction alone.
    out["io_overlapped_bound_s"] = max(moved / disk["read"], moved / disk["write"])
    out["ratio_to_overlapped_bound"] = min(out["step_s"]) / out["io_overlapped_bound_s"]
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
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of swapper and DeepSpeed aio")
    ap.add_argument("--dd-streams", type=int, default=4, help="parallel dd streams for the disk's bandwidth at depth")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache (root) before every timed read "
                                                                "and host step: no read is served from memory")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    directory = Path(args.dir) / "bench_nvme"
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = max(CHUNK, int(args.size_gb * 1e9) // CHUNK * CHUNK)
    res = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "bytes": nbytes, "threads": args.threads}
    res["dd"] = dd_bandwidth(directory / "dd.bin", nbytes, 1, args.drop_caches)
    res["dd_parallel"] = dd_bandwidth(directory / "dd.bin", nbytes, args.dd_streams, args.drop_caches)
    res["disk_best"] = {op: max(res["dd"][op], res["dd_parallel"][op]) for op in ("write", "read")}
    # Interleaved rounds: drift of the disk or the machine hits both alike; the best round of each is compared,
    # and so is each round's pair (median over rounds).
    rounds: dict[str, list[dict]] = {"swapper": [], "deepspeed_aio": []}
    aio_error = "skipped (--no-deepspeed)" if args.no_deepspeed else None
    for r in range(args.rounds):
        # The order flips every round (swapper first, then aio first, ...): on this virtual disk the place in
        # the round moved a path's bandwidth by as much as the paths differ, so a fixed order would bias them.
        for path in (("swapper", "aio") if r % 2 == 0 else ("aio", "swapper")):
            if path == "swapper":
                rounds["swapper"].append(swapper_bandwidth(directory, nbytes, args.threads, args.block_size,
                                                           args.buffers, args.drop_caches))
            elif aio_error is None:
                got = deepspeed_aio_bandwidth(directory, nbytes, args.threads, args.block_size, args.buffers,
                                              args.drop_caches)
                if "error" in got:
                    aio_error = got["error"]
                else:
                    rounds["deepspeed_aio"].append(got)
    res["rounds"] = rounds
    res["swapper"] = {"direct": rounds["swapper"][0]["direct"],
                      **{op: max(r[op] for r in rounds["swapper"]) for op in ("write", "read")}}
    res["deepspeed_aio"] = ({"error": aio_error} if aio_error is not None else
                            {op: max(r[op] for r in rounds["deepspeed_aio"]) for op in ("write", "read")})
    for op in ("write", "read"):
        if rounds["deepspeed_aio"]:     # paired within each round, then the median: drift between rounds cancels
            res["swapper"][f"{op}_vs_deepspeed_paired"] = statistics.median(
                a[op] / b[op] for a, b in zip(rounds["swapper"], rounds["deepspeed_aio"]))
        res["swapper"][f"{op}_vs_dd"] = res["swapper"][op] / res["dd"][op]
        res["swapper"][f"{op}_vs_disk_best"] = res["swapper"][op] / res["disk_best"][op]
        if op in res["deepspeed_aio"]:
            res["swapper"][f"{op}_vs_deepspeed"] = res["swapper"][op] / res["deepspeed_aio"][op]
    res["host_step"] = host_step(directory, args.adam_numel, args.sub_group, args.threads, args.block_size,
                                 res["disk_best"], args.drop_caches)
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
