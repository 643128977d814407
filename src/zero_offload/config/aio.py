"""The ``aio`` section: DeepSpeed's settings for reading and writing NVMe swap files."""
from __future__ import annotations

from dataclasses import dataclass

from zero_offload.config.schema import ConfigError, option

__all__ = ["AioConfig"]


@dataclass
class AioConfig:
    """DeepSpeed's ``aio`` block: how NVMe swap files are read and written."""
    block_size: int = option(1_048_576, "Bytes per I/O request piece (a multiple of 4096).", min=4096)
    queue_depth: int = option(8, "Requests in flight per I/O thread (libaio's queue depth; here blocking "
                                 "requests on thread_count x queue_depth workers).", min=1)
    intra_op_parallelism: int = option(1, "I/O threads that read and write swap files in parallel.", min=1)
    thread_count: int | None = option(None, "Older name of intra_op_parallelism; used when given.", min=1)
    single_submit: bool = option(False, "Accepted (a libaio submission mode); no effect with I/O threads.")
    overlap_events: bool = option(True, "Accepted (a libaio completion mode); no effect with I/O threads.")
    use_gds: bool = option(False, "GPUDirect Storage.", not_implemented={
        True: "GPUDirect Storage needs CUDA and NVIDIA cuFile; swap files go through host buffers"})

    def validate(self, path):
        if self.block_size % 4096:
            raise ConfigError(f"config key '{path}.block_size': got {self.block_size}, must be a multiple of "
                              "4096 bytes (O_DIRECT alignment)")

    @property
    def threads(self) -> int:
        return self.thread_count if self.thread_count is not None else self.intra_op_parallelism
