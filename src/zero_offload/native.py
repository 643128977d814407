"""Which native libraries this process uses, and where they are found (`zero_offload.native_files`).

Two live in the package: the fused host Adam kernel (`zero_offload.optim._native`) and the NVMe swapper's
native AIO path (`zero_offload.nvme._native`). ``ZERO_OFFLOAD_NO_NATIVE=1`` turns both off (their callers fall
back to torch and to ``os.preadv``/``os.pwritev``). `missing_libraries` says which are not built in a package
directory (``benchmarks/gpu_validate.py`` builds them then); `native_available` which this process uses.
"""
from __future__ import annotations

from zero_offload.native_files import LIBRARIES, missing_libraries, native_disabled, shared_library
from zero_offload.nvme import _native as aio
from zero_offload.optim import _native as adam

__all__ = ["LIBRARIES", "missing_libraries", "native_available", "native_disabled", "shared_library"]


def native_available() -> dict[str, bool]:
    """Whether each native library is loaded and used in this process: ``{"fused_adam": bool, "aio": bool}``;
    False when not built, not loadable, or ``ZERO_OFFLOAD_NO_NATIVE=1`` (each loader caches its answer)."""
    return {"fused_adam": adam.load() is not None, "aio": aio.available()}
