"""Which device a rank computes on, and how much of it is free: no collective here (`zero_offload.comm` uses them)."""
from __future__ import annotations

import os

import torch

__all__ = ["choose_device", "device_free_bytes"]


def device_free_bytes(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: ``torch.cuda.mem_get_info`` plus what the caching allocator holds
    unused on CUDA; the host's available memory (``psutil``) on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    import psutil
    return psutil.virtual_memory().available


def choose_device(backend: str | None, cuda: bool, environ=None) -> torch.device:
    """This rank's compute device.

    - no CUDA, or a gloo-only group (gloo reduces CPU tensors only): the CPU;
    - else ``cuda:LOCAL_RANK`` when the launcher set ``LOCAL_RANK`` (torchrun, the deepspeed launcher), whoever
      created the process group: DeepSpeed's engine binds the device from ``LOCAL_RANK`` the same way;
    - else the current CUDA device (``torch.cuda.set_device`` before `initialize`, as with DDP).

    Args:
        backend: ``dist.get_backend()`` of the group (None: no group).
        cuda: whether CUDA is available.
        environ: the environment to read (default ``os.environ``).

    Raises:
        ValueError: ``LOCAL_RANK`` is not an integer, or names a GPU this process does not see.
    """
    environ = os.environ if environ is None else environ
    if not cuda or (backend is not None and str(backend).lower() == "gloo"):
        return torch.device("cpu")
    raw = environ.get("LOCAL_RANK")
    if raw is None:
        return torch.device("cuda", torch.cuda.current_device())
    try:
        index = int(raw)
    except ValueError:
        raise ValueError(f"environment variable LOCAL_RANK={raw!r} must be an integer") from None
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"environment variable LOCAL_RANK={index} names a GPU this process does not see "
                         f"({count} visible: check CUDA_VISIBLE_DEVICES and --nproc_per_node)")
    return torch.device("cuda", index)
