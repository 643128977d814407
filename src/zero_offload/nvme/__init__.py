"""NVMe offload (ZeRO-Infinity, Rajbhandari et al. 2021, arXiv 2104.07857): an I/O layer of its own.

`buffers` holds aligned host buffers and their pool; `swapper` reads and writes them to swap files on I/O
threads; `adam` streams a rank's optimizer states through the pool for the host step.
"""
from zero_offload.nvme.buffers import AlignedBuffer, BufferPool, ALIGNMENT
from zero_offload.nvme.swapper import NvmeIOError, SwapFile, Swapper

__all__ = ["ALIGNMENT", "AlignedBuffer", "BufferPool", "NvmeIOError", "SwapFile", "Swapper"]
