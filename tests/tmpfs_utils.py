"""A small tmpfs for disk-full tests, where this machine lets us mount one (root, mount allowed)."""
import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    """Mount a tmpfs of ``size`` (e.g. "96k") at ``path`` for the block; skip the test where that is impossible."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
