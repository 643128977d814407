"""Building the NVMe optimizer from the config, with the checks DeepSpeed leaves to a crash later on.

`check_swap_directory` runs at initialize: the ``nvme_path`` must exist, be a directory and be writable,
and its filesystem must have room for every byte this rank will write (both numbers in the message).
"""
from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import torch

from zero_offload.config import Config, ConfigError
from zero_offload.nvme.param_store import PARAM_SUFFIX, NvmeParamStore
from zero_offload.nvme.state_files import STATE_FILES, bytes_needed, element_sizes

__all__ = ["check_swap_directory", "swap_directory", "build_param_store"]

KEY = "zero_optimization.offload_optimizer.nvme_path"


def swap_directory(nvme_path: "str | Path", rank: int) -> Path:
    """Where rank ``rank`` keeps its swap files under ``nvme_path``."""
    return Path(nvme_path) / "zero_offload" / f"rank{rank}"


def check_swap_directory(nvme_path: str, rank: int, need_bytes: int, key: str = KEY, what: str = "",
                         reclaimable: tuple[str, ...] = ("",)) -> Path:
    """This rank's swap directory under ``nvme_path``, created and checked.

    ``what`` says what the bytes are for (default: the optimizer states); files of this rank whose names end
    with one of ``reclaimable`` are stale (a killed run's, deleted at start) and count as free.

    Raises:
        ConfigError: naming ``key`` and the path: missing, not a directory, not writable, or less free space
            than ``need_bytes`` (bytes this rank will write).
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
    stale = sum(f.stat().st_blocks * 512 for f in directory.iterdir()
                if f.is_file() and f.name.endswith(reclaimable))
    free = shutil.disk_usage(directory).free + stale
    if free < need_bytes:
        raise ConfigError(f"config key '{key}' = '{nvme_path}': rank {rank} needs {need_bytes:,} bytes of swap "
                          f"files for {what or 'its optimizer states'}, but only {free:,} bytes are free there")
    return directory


def build_param_store(units: list, numels: list[int], dtype: torch.dtype, config: Config, rank: int) -> NvmeParamStore:
    """The stage-3 parameter store for ``offload_param.device = nvme``. The free-space check counts the
    parameter files and, when ``offload_optimizer`` swaps to the same ``nvme_path``, its state files too.

    Raises:
        ConfigError: as `check_swap_directory` (key ``offload_param.nvme_path``), or a ``buffer_count`` /
            ``buffer_size`` that cannot hold a unit's shard (naming the key and the size needed).
    """
    zc = config.zero_optimization
    op, oo = zc.offload_param, zc.offload_optimizer
    param_bytes = NvmeParamStore.bytes_needed(numels, dtype)
    need, what = param_bytes, f"its 16-bit parameters ({param_bytes:,} bytes)"
    reclaimable: tuple[str, ...] = (PARAM_SUFFIX,)
    if oo.device == "nvme" and Path(oo.nvme_path).resolve() == Path(op.nvme_path).resolve():
        state_bytes = bytes_needed(numels, zc.sub_group_size, element_sizes(config))
        need += state_bytes
        what += f" and optimizer states ({state_bytes:,} bytes)"
        reclaimable += STATE_FILES
    directory = check_swap_directory(op.nvme_path, rank, need, "zero_optimization.offload_param.nvme_path", what,
                                     reclaimable)
    try:
        return NvmeParamStore(numels, units, dtype, directory, op.buffer_count, op.buffer_size, op.max_in_cpu,
                              block_size=config.aio.block_size, thread_count=config.aio.threads,
                              queue_depth=config.aio.queue_depth,
                              pin=op.pin_memory and torch.cuda.is_available())   # shards go up from there
    except ValueError as e:
        raise ConfigError(str(e)) from e
