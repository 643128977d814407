"""The host memory a process may actually use: the locked-memory limit page-locked buffers count against, and the
cgroup's memory limit a container sets below the machine's RAM.

Containers cap both: a container inherits its runtime's ``RLIMIT_MEMLOCK`` (containerd under systemd: 8 MiB) unless
``--ulimit memlock`` raises it, and a Kubernetes pod runs in a memory cgroup the kernel's OOM killer enforces. A
plan sized to the machine's RAM, or page-locked buffers beyond what the driver and the runtime allow, fail there
(PyTorch #157146; DeepSpeed added an ``mlock`` pinning backend, DeepSpeed #8211). The limit binds an unprivileged
process; root holds ``CAP_IPC_LOCK``, which lifts it. The planner plans within these limits
(`zero_offload.estimate.planner.plan`'s ``host_memory`` and ``locked_memory``), and
`zero_offload.offload.pinned.host_empty` falls back to pageable memory where page-locking fails.
"""
from __future__ import annotations

import os
import resource
from pathlib import Path

import psutil

__all__ = ["memlock_limit", "cgroup_memory_limit", "usable_host_memory", "RAISE_MEMLOCK"]

RAISE_MEMLOCK = ("raise it with `ulimit -l unlimited` (Docker: `--ulimit memlock=-1`; Kubernetes: the container "
                 "runtime's memlock limit), or set offload_optimizer.pin_memory and offload_param.pin_memory to "
                 "false")
# cgroup v1 reports "no limit" as a page-rounded 2**63 - 1.
_UNLIMITED = 1 << 60


def memlock_limit() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes where it binds this process; None when unlimited, or when the process
    runs as root (``CAP_IPC_LOCK`` lifts the limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY or os.geteuid() == 0 else int(soft)


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory limit of this process's cgroup in bytes (v2 ``memory.max``, or v1 ``memory/memory.limit_in_bytes``),
    or None when there is none or it cannot be read."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = (root / name).read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        return None if value >= _UNLIMITED else value
    return None


def usable_host_memory() -> int:
    """The host memory this process may use: the machine's RAM, or the cgroup's limit where it is lower."""
    total = psutil.virtual_memory().total
    limit = cgroup_memory_limit()
    return total if limit is None else min(total, limit)
