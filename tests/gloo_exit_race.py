"""Reproduce the gloo exit race that `zero_offload.comm.handover` closes (soak of `test_comm_handover.py`).

    python tests/gloo_exit_race.py SRC RUNS [partitions|objects]

Each run forks two gloo ranks that make three collectives through ``zero_offload.comm`` (the bucketed parameter
all-gather, or `gather_objects`) and leave at once by ``sys.exit``, as a script returning from ``main`` does,
without ``destroy_process_group``. ``SRC`` is the ``src`` folder whose ``zero_offload`` is imported, so two
checkouts can be compared. Prints one JSON line: the runs and how many ended with an abort ("terminate called
without an active exception") or a non-zero exit code.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import sys
import tempfile

SRC, RUNS = sys.argv[1], int(sys.argv[2])
KIND = sys.argv[3] if len(sys.argv) > 3 else "partitions"
sys.path.insert(0, SRC)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from zero_offload import comm  # noqa: E402

gc.freeze()      # a child's interpreter finalizes in milliseconds, as a small script's does


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, err) -> None:
    os.dup2(err.fileno(), 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ctx = comm.DistContext.create()
    for _ in range(3):
        if KIND == "partitions":
            ctx.all_gather_partitions(torch.zeros(4000), 2000, 500)
        else:
            comm.gather_objects({"rank": rank})
    sys.exit(0)


def run() -> bool:
    port, pids, errs = free_port(), [], []
    for rank in range(2):
        err = tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:
            rank_main(rank, port, err)
        pids.append(pid)
        errs.append(err)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    text = ""
    for err in errs:
        err.seek(0)
        text += err.read().decode(errors="replace")
    return any(codes) or "terminate" in text.lower()


if __name__ == "__main__":
    print(json.dumps({"src": comm.__file__, "kind": KIND, "runs": RUNS, "aborts": sum(run() for _ in range(RUNS))}))
