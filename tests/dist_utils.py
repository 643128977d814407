"""Run a function on N gloo ranks in forked processes and collect each rank's return value."""
from __future__ import annotations

import faulthandler
import gc
import os
import socket
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero_offload.comm import collective_timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dump_and_exit() -> None:
    faulthandler.dump_traceback(all_threads=True)
    os._exit(70)


def _entry(rank, world_size, port, fn, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)   # the ranks share two cores
    # A hang in a collective fails within ZERO_OFFLOAD_TIMEOUT_S (default 10 minutes); one anywhere else (a lock
    # held across the fork, an exit that never ends) dumps every thread's stack and ends the rank a little later.
    # A timer thread of this process, not faulthandler's own watchdog, which the fork may have left mid-wait.
    watchdog = threading.Timer(_rank_deadline_s(), _dump_and_exit)
    watchdog.daemon = True
    watchdog.start()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=collective_timeout())
    try:
        result = fn(*args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def _rank_deadline_s() -> float:
    return collective_timeout().total_seconds() + 120


def run_ranks(fn, world_size: int, *args) -> list:
    """``fn(*args)`` on ``world_size`` gloo ranks; returns the per-rank results (rank order). A rank still running
    past the collective timeout plus two minutes fails the call (its stacks are in the test's captured stderr)."""
    # Garbage the parent has not collected (an engine in a reference cycle, its I/O threads) is collected here,
    # where its threads are, not by a rank's collector, which would find a copy whose threads were not forked.
    gc.collect()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world_size, _free_port(), fn, args, out_dir),
                                 nprocs=world_size, join=False, start_method="fork")
        limit = _rank_deadline_s() + 60          # each rank's own watchdog fires first
        deadline = time.monotonic() + limit
        try:
            while not ctx.join(timeout=max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    for process in ctx.processes:
                        process.kill()
                    raise AssertionError(f"ranks still running after {limit:.0f} s: killed")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:   # exit code 70: the watchdog
            raise AssertionError(f"a rank failed:\n{e}") from None
        results = [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
    for r, res in enumerate(results):
        if "error" in res:
            raise AssertionError(f"rank {r} failed:\n{res['error']}")
    return [res["ok"] for res in results]


def run_torchrun(script: str, out_path, timeout: int = 600) -> dict:
    """Run ``tests/<script> <out_path>`` under ``torchrun --nproc_per_node 2`` with the repository's ``src`` and
    ``tests`` importable; asserts it exited 0 (its stderr's end in the message) and returns the JSON its rank 0
    wrote to ``out_path`` (`finish_torchrun`)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_free_port()), str(tests / script), str(out_path)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out_path) as f:
        return json.load(f)


def finish_torchrun(result: dict, out_path: str) -> None:
    """End a script run under ``torchrun``: rank 0 writes ``result`` as JSON to ``out_path``, then an orderly exit
    (every rank at a barrier, the group destroyed, so gloo's threads stop before the interpreter ends)."""
    import json
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
