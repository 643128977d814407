"""Host-side figures of simulated streams (issue 20, section 2): per run of `tests/test_simulated_streams.py`,
the copies, collectives and NVMe pieces that ``ZERO_OFFLOAD_SIMULATE_STREAMS=1`` delays, and the run's wall time
without and with the simulation (one pass each; the first "off" run pays the process's warm-up).

    PYTHONPATH=src python benchmarks/bench_simulated_streams.py     # prints BENCHMARKS.md's table rows
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from dist_utils import run_ranks  # noqa: E402
from test_simulated_streams import RING_SLOT, RUNS, case_config, in_mode, summary  # noqa: E402
from zero_offload.offload import simulated, staging_ring  # noqa: E402


def counted(config: dict) -> tuple[float, tuple[int, int, int]]:
    """Wall seconds of one run and the work it delayed: (copies, collectives, NVMe pieces)."""
    before, t0 = simulated.counts(), time.perf_counter()
    summary(config)
    seconds, after = time.perf_counter() - t0, simulated.counts()
    return seconds, (after.copies - before.copies, after.collectives - before.collectives, after.io - before.io)


def main() -> None:
    staging_ring.SLOT_NUMEL = RING_SLOT          # as the test runs them
    for name, case, ws in RUNS:
        config = case_config(case, ws, tempfile.mkdtemp(prefix=f"sim-{name}-"))
        if ws == 1:
            off, sim = (in_mode(mode, counted, config) for mode in ("off", "sim"))
        else:
            off, sim = (run_ranks(in_mode, ws, mode, counted, config)[0] for mode in ("off", "sim"))
        print(f"| {name} | {ws} | {sim[1][0]} | {sim[1][1]} | {sim[1][2]} | {off[0]:.2f} | {sim[0]:.2f} |")


if __name__ == "__main__":
    main()
