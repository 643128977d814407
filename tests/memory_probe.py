"""For the memory tests: the process's anonymous RSS, read from /proc/self/status, and its peak growth while a
function runs (sampled on a thread every millisecond) -- measured, not a formula -- and a model of one large
parameter whose optimizer state dominates the process."""
import json
import subprocess
import sys
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


def rss_anon() -> int:
    """Bytes of anonymous resident memory of this process (RssAnon)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def peak_during(fn) -> int:
    """Run ``fn()``; return the most RssAnon grew above its value at the start while it ran (bytes)."""
    base = rss_anon()
    peak, done = [base], [False]

    def sample():
        while not done[0]:
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done[0] = True
        t.join()
    return max(peak[0], rss_anon()) - base


def run_fresh(script: str, *args) -> dict:
    """Run ``script`` (Python source) in a fresh interpreter with ``args`` and this folder as the last argument
    (nothing of another engine alive: its RSS is its own); return the JSON object on its last output line."""
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
