"""Writing a safetensors file piece by piece, so a rank's optimizer state never has to be whole in memory.

``safetensors.torch.save_file`` takes whole tensors. The format is simple enough to stream: an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range in the data
section (padded with spaces to a multiple of 8, as the reference writer does), then the raw data. With every
tensor's dtype and shape known up front the header is written first and each piece of a tensor goes to its
place with ``pwrite``; the file is the same format ``safe_open`` / ``load_file`` read.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

__all__ = ["StreamedSafetensors"]

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}


class StreamedSafetensors:
    """A safetensors file at ``path`` with tensors ``specs`` = {name: (dtype, shape)}, in that order, and string
    ``metadata``; fill each tensor with `write` (any pieces, any order), then `close` (or `abort` after an error).

    Raises:
        OSError: from the writes (ENOSPC and the like; the caller names the file).
        ValueError: a piece outside its tensor, an unknown dtype, or `close` with bytes never written.
    """

    def __init__(self, path: str | os.PathLike, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self.spans: dict[str, tuple[int, int, int]] = {}      # name -> (begin byte, end byte, itemsize)
        offset = 0
        for name, (dtype, shape) in specs.items():
            if dtype not in _DTYPES:
                raise ValueError(f"StreamedSafetensors: dtype {dtype} of '{name}' is not supported")
            itemsize = torch.empty(0, dtype=dtype).element_size()
            numel = 1
            for d in shape:
                numel *= int(d)
            header[name] = {"dtype": _DTYPES[dtype], "shape": [int(d) for d in shape],
                            "data_offsets": [offset, offset + numel * itemsize]}
            self.spans[name] = (offset, offset + numel * itemsize, itemsize)
            offset += numel * itemsize
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self.written = {name: 0 for name in specs}
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._pwrite(struct.pack("<Q", len(text)) + text, 0)
            os.ftruncate(self.fd, self.data_start + offset)
        except BaseException:
            os.close(self.fd)
            raise

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def write(self, name: str, element_offset: int, piece: torch.Tensor) -> None:
        """Write ``piece`` (1-D or any shape, flattened; the tensor's dtype) at ``element_offset`` of ``name``."""
        begin, end, itemsize = self.spans[name]
        data = piece.detach().reshape(-1).contiguous().cpu()
        lo = begin + element_offset * itemsize
        hi = lo + data.numel() * itemsize
        if element_offset < 0 or hi > end or data.element_size() != itemsize:
            raise ValueError(f"StreamedSafetensors: a piece of {data.numel()} elements at {element_offset} does "
                             f"not fit tensor '{name}' of {(end - begin) // itemsize} elements")
        if data.numel():
            self._pwrite(data.view(torch.uint8).numpy(), self.data_start + lo)
        self.written[name] += hi - lo

    def abort(self) -> None:
        """Close the file after a failed write (the caller removes it)."""
        os.close(self.fd)

    def close(self) -> None:
        """Close the file; every byte of every tensor must have been written once."""
        os.close(self.fd)
        short = [n for n, (b, e, _) in self.spans.items() if self.written[n] != e - b]
        if short:
            raise ValueError(f"StreamedSafetensors: '{self.path}' tensors {short[:3]} were not written whole")
