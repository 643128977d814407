"""Run many `exit_script.py` cases fast, for the soak of `test_clean_exit.py` (issue 26).

    python tests/exit_driver.py CASES_JSON REPETITIONS

The driver imports torch and the script once, then forks one child per rank per run. Each child runs the script's
``main`` and leaves through the interpreter's normal exit (``sys.exit``: threads joined, `atexit` run, the
interpreter finalized), exactly as a script returning from ``main`` does; only the imports are shared. Two-rank
runs are two children joined in a gloo group on a fresh port. Prints one JSON list: per run, the case, the exit
codes and the stderr of each rank.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import sys
import tempfile
import warnings

warnings.simplefilter("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exit_script  # noqa: E402  (imports torch and zero_offload once, before any fork)
import torch  # noqa: E402

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])   # imports torch._dynamo once, before forking
gc.freeze()              # the children's interpreters finalize in tens of ms, not a second

SIMULATE = "ZERO_OFFLOAD_SIMULATE_STREAMS"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(case: dict, rank: int, ws: int, port: int, err) -> None:
    os.dup2(err.fileno(), 2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.environ.pop(SIMULATE, None)
    if case["sim"]:
        os.environ[SIMULATE] = "1"
    if ws > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    code = 0
    try:
        exit_script.main(case)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.exit(code)                    # the interpreter's normal exit, as a script's


def run(case: dict) -> dict:
    ws, port = case["ranks"], free_port()
    pids, errs = [], []
    for rank in range(ws):
        err = tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:
            child(case, rank, ws, port, err)
        pids.append(pid)
        errs.append(err)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    stderr = []
    for err in errs:
        err.seek(0)
        stderr.append(err.read().decode(errors="replace"))
    return {"case": case, "codes": codes, "stderr": stderr}


if __name__ == "__main__":
    cases, reps = json.loads(sys.argv[1]), int(sys.argv[2])
    print(json.dumps([run(c) for _ in range(reps) for c in cases]))
