"""A process that ends while a delayed-update host step is still running in the background exits cleanly
(issue 20, section 1: 1 run in 6 of a short DPU script under ``ZERO_OFFLOAD_NO_NATIVE=1`` aborted at exit with
"terminate called without an active exception", exit 134).

Each run is a child forked from a driver that imported torch once (a fresh interpreter per run would cost
seconds each); the child trains 2 steps with the delayed update from step 0 and returns from its script at
once, so the interpreter finalizes with the second host step launched. So that the step is still in flight
then on every run, whatever the timing, the child's background step first runs torch ops until the main
thread has begun to exit, and some more after, before the real step: a daemon thread is then always inside
torch's C++ when the interpreter finalizes. Native kernel and torch fallback, in parallel drivers.
"""
import json
import os
import subprocess
import sys
from pathlib import Path


RUNS = 3                 # per mode; without the fix 32 of 32 such runs aborted (exit -6, SIGABRT): 3 suffice

DRIVER = r'''
import gc, json, os, sys, tempfile, threading, warnings
warnings.simplefilter("ignore")
import torch
import zero_offload
from zero_offload.hoststep.delayed import DelayedParamUpdate
sys.path.insert(0, sys.argv[-1])
from memory_probe import OneVector
runs, n = int(sys.argv[1]), 1 << 20
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])   # imports torch._dynamo once, before forking
real_step = DelayedParamUpdate._detached_step
launched = [0]

def held_step(self, *args, **kwargs):
    """The real host step; the last one is held in flight until the main thread has begun to exit."""
    launched[0] += 1
    if launched[0] == 2:             # the first is joined by the second engine.step(): not held
        t = torch.ones(4096)
        for _ in range(10**6):       # bounded, so a child can never spin for ever
            if not threading.main_thread().is_alive():
                break
            t.mul_(1.0)
        os.write(2, b"held step: the main thread is exiting\n")
        for _ in range(20000):       # ~0.1 s; torch's C++ releases and retakes the GIL in each
            t.mul_(1.0)
    return real_step(self, *args, **kwargs)

cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_param_update": True,
                                                               "dpu_warmup_steps": 0}}}
gc.freeze()              # the children's interpreters finalize faster (tens of ms, not a second)
results = []
for i in range(runs):
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:                      # the child: runs, then leaves through the interpreter's normal exit
        os.dup2(err.fileno(), 2)
        DelayedParamUpdate._detached_step = held_step
        torch.manual_seed(i)
        engine = zero_offload.initialize(OneVector(n), cfg)
        x = torch.randn(16)
        for _ in range(2):
            engine.backward(engine(x))
            engine.step()
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    err.seek(0)
    results.append({"code": os.waitstatus_to_exitcode(status), "stderr": err.read().decode(errors="replace")})
print(json.dumps(results))
'''


def test_exit_with_a_delayed_step_in_flight_is_clean():
    tests = Path(__file__).resolve().parent
    procs = {}
    for mode in ("native", "fallback"):
        env = dict(os.environ)
        env.pop("ZERO_OFFLOAD_NO_NATIVE", None)
        if mode == "fallback":
            env["ZERO_OFFLOAD_NO_NATIVE"] = "1"
        procs[mode] = subprocess.Popen([sys.executable, "-c", DRIVER, str(RUNS), str(tests)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for mode, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{mode} driver: {err[-3000:]}"
            results = json.loads(out.strip().splitlines()[-1])
            assert len(results) == RUNS
            for i, r in enumerate(results):
                assert "terminate called" not in r["stderr"], f"{mode} run {i}: {r['stderr'][-1000:]}"
                assert r["code"] == 0, f"{mode} run {i}: exit {r['code']}: {r['stderr'][-1000:]}"
                assert "held step: the main thread is exiting" in r["stderr"], f"{mode} run {i}: not in flight"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
