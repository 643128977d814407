"""The ``checkpoint`` section: DeepSpeed 0.19.8's keys, accepted without effect, and whether pickles are trusted."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from zero_offload.config.compat import IGNORED_CHECKPOINT
from zero_offload.config.schema import option

__all__ = ["CheckpointConfig"]



@dataclass
class CheckpointConfig:
    IGNORED: ClassVar[dict[str, str]] = IGNORED_CHECKPOINT
    trust_pickles: bool = option(False, "Not a DeepSpeed key: load pickled client state (and DeepSpeed's model "
                                        "states) holding types outside the allow-list of data types (containers, "
                                        "numbers, strings, tensors, numpy arrays, argparse.Namespace). Unpickling "
                                        "such a type can run code named by the file: set it only for files you "
                                        "trust. Off, such a file is refused, naming the file and the type.")
