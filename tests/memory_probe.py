"""For the memory tests: the process's anonymous RSS, read from /proc/self/status, and its peak growth while a
function runs (sampled on a thread every millisecond) -- measured, not a formula -- small models whose memory
is dominated by a known number of parameters (one large parameter, many equal units, a frozen base beside a
small trainable part), and fresh interpreters to measure in (one, or one per rank of a gloo group)."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch


class OneVector(torch.nn.Module):
    """One parameter of ``n`` elements (fp32: 12 n bytes of master weights and Adam moments), every element
    with a gradient."""

    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return (self.w[:x.numel()] * x).sum() + self.w.square().sum() * 1e-3


class Piece(torch.nn.Module):
    """One parameter of ``m`` seeded random elements (one stage-3 unit); its forward touches all of them."""

    def __init__(self, m: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(m))

    def forward(self, x):
        return x + self.w.square().mean()


class Pieces(torch.nn.Module):
    """``k`` `Piece` modules of ``n // k`` elements: ``n`` parameters in ``k`` equal units, none larger than
    ``n / k`` (so a unit-by-unit transient is told apart from a whole-model one)."""

    def __init__(self, n: int, k: int):
        super().__init__()
        self.pieces = torch.nn.ModuleList(Piece(n // k) for _ in range(k))

    def forward(self, x):
        for p in self.pieces:
            x = p(x)
        return x.sum()


class FrozenBase(torch.nn.Module):
    """A frozen (``requires_grad=False``) parameter of ``n`` seeded random elements and a trainable one of
    ``m``, as a LoRA run on a frozen base; the forward reads slices only, so it makes no full-size temporary."""

    def __init__(self, n: int, m: int):
        super().__init__()
        self.base = torch.nn.Parameter(torch.randn(n), requires_grad=False)
        self.adapter = torch.nn.Parameter(torch.randn(m) * 0.01)

    def forward(self, x):
        k = x.numel()
        return ((self.base[:k] + self.adapter[:k]) * x).sum() + self.adapter.square().sum()


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_anon() -> int:
    """Bytes of anonymous resident memory of this process (RssAnon)."""
    return _status("RssAnon")


def rss_total() -> int:
    """Bytes of all resident memory of this process (VmRSS: anonymous, file pages it maps, shared memory)."""
    return _status("VmRSS")


def peak_during(fn, probe=rss_anon) -> int:
    """Run ``fn()``; return the most ``probe()`` (RssAnon unless given) grew above its value at the start while it
    ran (bytes)."""
    base = probe()
    peak, done = [base], [False]

    def sample():
        while not done[0]:
            peak[0] = max(peak[0], probe())
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done[0] = True
        t.join()
    return max(peak[0], probe()) - base


def run_fresh(script: str, *args) -> dict:
    """Run ``script`` (Python source) in a fresh interpreter with ``args`` and this folder as the last argument
    (nothing of another engine alive: its RSS is its own); return the JSON object on its last output line."""
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_fresh_ranks(script: str, world_size: int, *args) -> list[dict]:
    """Run ``script`` as ``world_size`` ranks of a gloo group, each a fresh interpreter launched as torchrun
    would (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set; arguments as `run_fresh`), so each
    rank's RSS is its own and nothing ran in it before; return each rank's JSON object (rank order)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        logs.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))   # files: a pipe could fill
        procs.append(subprocess.Popen([sys.executable, "-c", script, *map(str, args), str(Path(__file__).parent)],
                                      env=env, stdout=logs[-1][0], stderr=logs[-1][1], text=True))

    def read(f):
        f.seek(0)
        return f.read()
    try:
        deadline = time.monotonic() + 600
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            assert not failed, "".join(f"rank {r} failed:\n{read(logs[r][1])[-3000:]}" for r in failed)
            assert time.monotonic() < deadline, "the ranks did not finish within 600 s"
            time.sleep(0.05)
        for rank, proc in enumerate(procs):
            assert proc.returncode == 0, f"rank {rank} failed:\n{read(logs[rank][1])[-3000:]}"
        return [json.loads(read(out).strip().splitlines()[-1]) for out, _ in logs]
    finally:
        for proc in procs:          # a rank that failed leaves the others waiting in a collective
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for out, err in logs:
            out.close()
            err.close()
