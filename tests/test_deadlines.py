"""Deadlines: a stalled rank makes the others fail with an error naming the timeout and their rank, within the
configured deadline, instead of blocking for 30 minutes."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from zero_offload.comm import collective_timeout

HERE = os.path.dirname(__file__)
RANK = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {here!r})
    torch.set_num_threads(1)
    import zero_offload
    from zero_offload.comm import CollectiveTimeoutError
    from reference import MICRO, engine_config
    from toy_model import batch, make_model
    rank = int(os.environ["RANK"])
    engine = zero_offload.initialize(make_model(), engine_config(2, "cpu", 1, ws=2))
    try:
        for step in range(50):
            if step == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)      # a stalled rank: alive, holding its sockets
            x, y = batch(step, 2 * MICRO)
            engine.backward(engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
            engine.step()
    except CollectiveTimeoutError as e:
        print("TIMEOUT", e, flush=True)
        # The subject here is the error; leave at once. A rank leaving through the interpreter's exit while its
        # peer is stalled (SIGSTOP, its sockets held) aborts 1 run in ~10 with "terminate called without an
        # active exception", on the session-start code as now: an open bug (issue 26's note), not this test's.
        os._exit(3)
    print("FINISHED", flush=True)
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stalled_rank_makes_the_others_raise_naming_the_timeout_and_rank():
    timeout_s = 3
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "ZERO_OFFLOAD_TIMEOUT_S": str(timeout_s), "PYTHONPATH": os.pathsep.join(sys.path)}
    code = RANK.format(here=HERE)
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=240)   # far above the deadline, far below 30 minutes
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 3, (out, err[-3000:])
    assert "rank 0 of 2" in out and f"within {timeout_s} s" in out and "ZERO_OFFLOAD_TIMEOUT_S" in out


def test_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv("ZERO_OFFLOAD_TIMEOUT_S", raising=False)
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    assert collective_timeout().total_seconds() == 600
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "2")          # DeepSpeed's variable counts minutes
    assert collective_timeout().total_seconds() == 120
    monkeypatch.setenv("ZERO_OFFLOAD_TIMEOUT_S", "7.5")   # ours counts seconds and wins
    assert collective_timeout().total_seconds() == 7.5
    monkeypatch.setenv("ZERO_OFFLOAD_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="ZERO_OFFLOAD_TIMEOUT_S='soon' must be a positive number of seconds"):
        collective_timeout()
