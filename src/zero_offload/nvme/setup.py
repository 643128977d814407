"""Building the NVMe optimizer from the config, with the checks DeepSpeed leaves to a crash later on.

`check_swap_directory` runs at initialize: the ``nvme_path`` must exist, be a directory and be writable,
and its filesystem must have room for every byte this rank will write (both numbers in the message).
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch

from zero_offload.config import Config, ConfigError
from zero_offload.nvme.adam import NvmeAdam, swap_directory
from zero_offload.offload.copies import CopyEngine

__all__ = ["check_swap_directory", "build_nvme_adam"]

KEY = "zero_optimization.offload_optimizer.nvme_path"


def check_swap_directory(nvme_path: str, rank: int, need_bytes: int, key: str = KEY) -> Path:
    """This rank's swap directory under ``nvme_path``, created and checked.

    Raises:
        ConfigError: naming ``key`` and the path: missing, not a directory, not writable, or less free space
            than ``need_bytes`` (bytes this rank will write; stale files of this rank count as free).
    """
    root = Path(nvme_path)
    if not root.exists():
        raise ConfigError(f"config key '{key}' = '{nvme_path}': the directory does not exist")
    if not root.is_dir():
        raise ConfigError(f"config key '{key}' = '{nvme_path}': not a directory")
    directory = swap_directory(root, rank)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"config key '{key}' = '{nvme_path}': not writable ({e.strerror or e})") from e
    stale = sum(f.stat().st_blocks * 512 for f in directory.iterdir() if f.is_file())
    free = shutil.disk_usage(directory).free + stale
    if free < need_bytes:
        raise ConfigError(f"config key '{key}' = '{nvme_path}': rank {rank} needs {need_bytes:,} bytes of swap "
                          f"files for its optimizer states, but only {free:,} bytes are free there")
    return directory


def build_nvme_adam(parts: list[torch.Tensor], hparams: list[dict], copies: CopyEngine, config: Config,
                    rank: int) -> NvmeAdam:
    """The NVMe optimizer for this rank's ``parts`` as ``config`` (offload_optimizer, aio, sub_group_size)
    asks; see `check_swap_directory` for the errors."""
    zc = config.zero_optimization
    oo = zc.offload_optimizer
    if config.optimizer.torch_kwargs is not None or config.optimizer.params.amsgrad:
        raise ConfigError(f"config key 'zero_optimization.offload_optimizer.device' = 'nvme' streams Adam's "
                          f"states through its buffers; optimizer.type = {config.optimizer.type!r}"
                          f"{' with amsgrad' if config.optimizer.params.amsgrad else ''} needs device 'cpu'")
    need = NvmeAdam.bytes_needed([p.numel() for p in parts], zc.sub_group_size)
    directory = check_swap_directory(oo.nvme_path, rank, need)
    return NvmeAdam(parts, hparams, copies, directory, zc.sub_group_size, oo.buffer_count, oo.pipeline_read,
                    oo.pipeline_write, block_size=config.aio.block_size, thread_count=config.aio.threads)
