"""``deepspeed.utils.logging``: DeepSpeed's ``logger`` (named "DeepSpeed") and ``log_dist``."""
from __future__ import annotations

import logging
import os
import sys

__all__ = ["logger", "log_dist", "log_dist_once", "set_log_level_from_string", "LoggerFactory"]


class LoggerFactory:
    @staticmethod
    def create_logger(name=None, level=logging.WARNING) -> logging.Logger:
        """A logger writing ``[time] [LEVEL] [file:line:function] message`` to stdout, as DeepSpeed's."""
        if name is None:
            raise ValueError("name for logger cannot be None")
        made = logging.getLogger(name)
        made.setLevel(level)
        made.propagate = False
        if not made.handlers:
            handler = logging.StreamHandler(stream=sys.stdout)
            handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] "
                                                   "[%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
            made.addHandler(handler)
        return made


logger = LoggerFactory.create_logger(name="DeepSpeed", level=os.environ.get("DS_LOG_LEVEL", "WARNING").upper())
_LOGGED_ONCE: set = set()


def log_dist(message: str, ranks=None, level=logging.INFO) -> None:
    """Log ``message``, prefixed with the rank, as DeepSpeed's: on every rank before a process group exists;
    after, on the ranks in ``ranks`` (all when its first entry is -1; none when it is empty or None)."""
    import torch.distributed as dist
    initialized = dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    ranks = list(ranks or [])
    if not initialized or (ranks and ranks[0] == -1) or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def log_dist_once(message: str, ranks=None, level=logging.INFO) -> None:
    if message not in _LOGGED_ONCE:
        _LOGGED_ONCE.add(message)
        log_dist(message, ranks, level)


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    (custom_logger or logger).setLevel(getattr(logging, log_level_str.upper()))
