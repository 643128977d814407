"""Write-behind of stage-3 parameters to NVMe (`NvmeParamStore.write_behind`): bandwidth by ring window size.

After each optimizer step with ``offload_param: nvme`` the updated parameters are rounded into a ring of
`WRITE_RING` aligned windows and written behind. This times writing ``--numel`` fp32 parameters, in
sub-group sized calls as `NvmeAdam` makes them, for each window size in ``--windows`` (MiB), interleaved in
``--rounds`` rounds, and prints GB/s per round and the median.

    python benchmarks/bench_param_writes.py --dir /work/nvme_scratch --numel 500000000 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from zero_offload.nvme import param_store


def write_all(directory: Path, values: torch.Tensor, window: int, sub_group: int) -> float:
    """GB/s of writing ``values`` behind through a ring of ``window``-byte buffers, flush included."""
    param_store.WRITE_WINDOW = window
    store = param_store.NvmeParamStore([values.numel()], [], values.dtype, directory, 1, 1, 0, thread_count=2,
                                       queue_depth=8)
    t0 = time.perf_counter()
    for lo in range(0, values.numel(), sub_group):
        store.write_behind(0, lo, values[lo:lo + sub_group])
    store.flush()
    seconds = time.perf_counter() - t0
    store.close()
    return values.numel() * values.element_size() / seconds / 1e9


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work/nvme_scratch")
    ap.add_argument("--numel", type=int, default=500_000_000, help="fp32 parameters written per measurement")
    ap.add_argument("--sub-group", type=int, default=25_000_000, help="elements per write_behind call")
    ap.add_argument("--windows", default="1,4,8,16", help="ring window sizes to compare, MiB")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    values = torch.randn(args.numel)
    windows = [int(w) << 20 for w in args.windows.split(",")]
    gbps: dict[int, list[float]] = {w: [] for w in windows}
    for r in range(args.rounds):
        for w in windows if r % 2 == 0 else windows[::-1]:
            gbps[w].append(write_all(Path(args.dir) / "bench_param_writes", values, w, args.sub_group))
    out = {f"{w >> 20} MiB": {"GB/s": gbps[w], "median": statistics.median(gbps[w])} for w in windows}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
