"""The staged gradient add (`zero_offload.optim.host_add.accumulate`) against torch's two passes (``dst.add_(src)``
then an fp32 ``vector_norm``), interleaved in each round: median ms and GB/s (10 bytes per element: the 16-bit piece
read, the fp32 partition read and written).

    python benchmarks/bench_host_add.py --elements 16777216 --rounds 7
"""
import argparse
import statistics
import time

import torch

from zero_offload.optim import host_add


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=1 << 24)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    n = args.elements
    dst, src = torch.randn(n), torch.randn(n).bfloat16()
    threads = sorted({1, host_add.STAGED_ADD_THREADS, torch.get_num_threads()})
    paths = {"torch (add_ + vector_norm)": lambda: torch.linalg.vector_norm(dst.add_(src), dtype=torch.float32)}
    paths.update({f"native, {t} thread(s)": (lambda t=t: host_add.accumulate(dst, src, False, t)) for t in threads})
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(args.rounds):
        for name, run in paths.items():          # interleaved: the VM's bandwidth drifts between rounds
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["torch (add_ + vector_norm)"])
    print(f"{n:,} elements, bf16 piece into fp32, torch threads {torch.get_num_threads()}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:28s} {1e3 * med:7.1f} ms  {10 * n / med / 1e9:5.1f} GB/s  {base / med:4.2f}x torch")


if __name__ == "__main__":
    main()
