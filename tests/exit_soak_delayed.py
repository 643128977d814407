"""Two ranks that end as most scripts do, without `engine.close()`, and a soak that counts aborts at exit (issue 59,
item 6; `test_clean_exit.py` runs one job in CI, BENCHMARKS.md records the long soak).

    python tests/exit_soak_delayed.py run POLICY                       # one job, ranks by mp.spawn
    python tests/exit_soak_delayed.py soak POLICY RUNS [--spawn] [--nice] [--unfixed]

POLICY: ``delayed`` (the delayed update from step 1), ``sync`` (synchronous offload) or ``super`` (super_offload).
Each rank trains 7 steps of ZeRO stage 2 with the optimizer offloaded to the CPU on gloo, calls
``engine.full_state_dict()``, all-reduces a tensor of its own, then ``barrier`` and ``destroy_process_group``,
prints how many of the group's threads are still alive, and returns.

The abort (std::terminate: SIGABRT, "terminate called without an active exception"): a gloo worker let go of the
script's all-reduced tensor after the interpreter had begun to finalize (taking the GIL there ends the thread by a
forced unwind). ``destroy_process_group`` joins those workers, unless something still holds the group:
``torch.distributed.nn.functional``'s defaults (``group=group.WORLD``) hold it when that module is first imported
after ``init_process_group``, as the first torch optimizer does through ``torch._dynamo``.

The soak runs RUNS jobs in a row beside a CPU burner and prints one JSON line: the runs, the aborts (a non-zero
exit or "terminate called" on stderr), the jobs whose group outlived ``destroy_process_group`` (``pinned``), and
the first failures' stderr. By default each job's ranks are forked from the soak (torch imported once: seconds per
job; torch._dynamo as a spawned rank first imports it, after its group exists); ``--spawn`` starts each job as a
user does (``mp.spawn``, tens of seconds). ``--nice`` lowers the priority of gloo's workers (nice 19), so that the
burner often holds one off between completing a collective and letting go of its tensors, as a loaded machine
now and then does.
"""
from __future__ import annotations

import faulthandler
import importlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent
POLICIES = {"sync": {}, "delayed": {"delayed_param_update": True, "dpu_warmup_steps": 1},
            "super": {"super_offload": True}}
GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")     # a gloo group's (and its store's)
LATE_IMPORT = "torch.distributed.nn.functional"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_names() -> list[str]:
    """This process's threads' names (Linux); empty where /proc is missing."""
    names = []
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:           # ended meanwhile
            pass
    return names


def deprioritize_gloo_workers() -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "pt_gloo_runloop":
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)
        except OSError:
            pass


def rank_main(rank: int, policy: str, port: int, nice: bool = False) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(TESTS))
    import zero_offload
    from toy_model import batch, make_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if nice:
        deprioritize_gloo_workers()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 500, "overlap_comm": True,
                                    "offload_optimizer": {"device": "cpu", **POLICIES[policy]}}}
    engine = zero_offload.initialize(make_model(), config)
    for step in range(7):
        x, y = batch(step, 4)
        loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
    state = engine.full_state_dict()
    total = torch.tensor([sum(float(t.sum()) for t in state.values())])
    dist.all_reduce(total)
    dist.barrier()
    dist.destroy_process_group()
    left = sum(name in GROUP_THREADS for name in thread_names())
    print(json.dumps({"rank": rank, "group_threads": left}), flush=True)
    # returns without engine.close(), as most scripts do


def run_job(policy: str, nice: bool = False) -> None:
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(policy, free_port(), nice), nprocs=2, join=True)


def spawned(policy: str, nice: bool, timeout_s: float) -> tuple[int, str, str]:
    """One job as a user starts it: a fresh interpreter whose ranks mp.spawn starts. (code, stdout, stderr)"""
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    p = subprocess.Popen([sys.executable, __file__, "run", policy] + (["--nice"] if nice else []), env=env,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return p.returncode, out, err


def forked(policy: str, nice: bool, timeout_s: float, late_import: bool) -> tuple[int, str, str]:
    """One job in seconds: both ranks forked from this process, each leaving through the interpreter's normal exit
    (``sys.exit``), as a spawned rank does once its function returns. ``late_import``: import LATE_IMPORT again
    right after ``init_process_group``, where a spawned rank first imports it (see `soak`)."""
    port, pids, files = free_port(), [], []
    for rank in range(2):
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            faulthandler.enable()
            if late_import:
                import_after_init()
            code = 0
            try:
                rank_main(rank, policy, port, nice)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.exit(code)
        pids.append(pid)
        files.append((out, err))
    deadline, codes = time.monotonic() + timeout_s, []
    for pid in pids:
        while not (status := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
            time.sleep(0.01)
        codes.append(os.waitstatus_to_exitcode(status[1]))
    texts = []
    for out, err in files:
        for f in (out, err):
            f.seek(0)
        texts.append((out.read().decode(errors="replace"), err.read().decode(errors="replace")))
    stderr = "".join(f"[rank {r}: exit {codes[r]}]\n{e}" for r, (_, e) in enumerate(texts))
    return next((c for c in codes if c), 0), "".join(o for o, _ in texts), stderr


def import_after_init() -> None:
    import torch.distributed as dist
    real = dist.init_process_group

    def init_then_import(*args, **kwargs):
        real(*args, **kwargs)
        sys.modules.pop(LATE_IMPORT, None)
        importlib.import_module(LATE_IMPORT)

    dist.init_process_group = init_then_import


def pinned(stdout: str) -> bool:
    """A rank reported threads of its group alive after ``destroy_process_group``."""
    reports = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", stdout)]   # the ranks' lines may run together
    return any(d["group_threads"] for d in reports)


def soak(policy: str, runs: int, spawn: bool = False, nice: bool = False, timeout_s: float = 300.0,
         unfixed: bool = False) -> dict:
    """``runs`` jobs of ``policy`` one after another, beside a process that keeps a core busy. ``unfixed``: import
    LATE_IMPORT again after ``init_process_group`` in every forked rank, as before zero_offload imported it first
    (the order that left the group held)."""
    late_import = False
    if not spawn:
        import torch
        import zero_offload  # noqa: F401  (what a spawned rank imports before its function runs)
        # A spawned rank imports torch._dynamo at its first torch optimizer, after init_process_group; here it is
        # imported once, before forking (seconds per job saved), and LATE_IMPORT, which it imports and which only
        # that order matters for, again after init in each rank -- unless zero_offload imported it already.
        late_import = unfixed or LATE_IMPORT not in sys.modules
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    aborts, kept, failures, started = 0, 0, [], time.monotonic()
    try:
        for _ in range(runs):
            code, out, err = spawned(policy, nice, timeout_s) if spawn else \
                forked(policy, nice, timeout_s, late_import)
            kept += pinned(out)
            if code != 0 or "terminate called" in err:
                aborts += 1
                if len(failures) < 3:
                    failures.append(f"exit {code}: {err[-4000:]}")
    finally:
        burner.kill()
        burner.wait()
    return {"policy": policy, "runs": runs, "spawn": spawn, "nice": nice, "unfixed": late_import, "aborts": aborts, "pinned": kept,
            "seconds": round(time.monotonic() - started), "failures": failures}


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run_job(sys.argv[2], "--nice" in sys.argv)
    else:
        print(json.dumps(soak(sys.argv[2], int(sys.argv[3]), spawn="--spawn" in sys.argv, nice="--nice" in sys.argv,
                              unfixed="--unfixed" in sys.argv)))
