"""Running a row's benchmark command for the report, and the stamp of the machine it ran on.

A command runs from the repository root with this checkout's ``src`` first on ``PYTHONPATH`` (the code measured is
the checkout's), ``python`` replaced by this interpreter; its output is echoed to stderr as it comes, so that a run of
many minutes shows progress. The result is the JSON file its ``json_flag`` named, or ``{"stdout": text}``.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.report_types import ROOT, Command


def command_argv(command: Command, json_path: Path | None, quick: bool) -> list[str]:
    """The argv run: the command, then its JSON option with ``json_path``, then (``quick``) its reduced sizes."""
    argv = [sys.executable if a == "python" else a for a in command.argv]
    if command.json_flag is not None and json_path is not None:
        argv += [command.json_flag, str(json_path)]
    return argv + list(command.quick if quick else ())


def run_command(command: Command, workdir: Path, quick: bool, timeout: float | None = None) -> Any:
    """Run ``command`` and return its result; ``workdir`` holds its JSON file. Raises RuntimeError when the command
    fails or writes no result."""
    json_path = workdir / (hashlib.sha1(command.text().encode()).hexdigest()[:12] + ".json")
    json_path.unlink(missing_ok=True)
    env = dict(os.environ, **dict(command.env))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    argv = command_argv(command, json_path if command.json_flag else None, quick)
    print(f"$ {' '.join(argv)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:            # echoed as it comes: a full run takes minutes
            lines.append(line)
            sys.stderr.write(line)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"{command.text()}: no result within {timeout} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{command.text()} exited with {proc.returncode}")
    if command.json_flag is None:
        return {"stdout": "".join(lines)}
    if not json_path.exists():
        raise RuntimeError(f"{command.text()} wrote no {command.json_flag} file")
    return json.loads(json_path.read_text())


def cpu_model(cpuinfo: str) -> str:
    """The CPU's model name and widest vector ISA (AVX-512, AVX2) from the text of /proc/cpuinfo."""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = fields.get("flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    model = fields.get("model name", "unknown CPU")
    return f"{model} ({isa})" if isa else model


def machine() -> str:
    """This machine as the table's machine column gives it: CPU model and ISA, core count, torch's version."""
    try:
        cpu = cpu_model(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = "unknown CPU"
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch}"


def today() -> str:
    """Today's date, ISO 8601 (the table's date column)."""
    return datetime.date.today().isoformat()
