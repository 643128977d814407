"""``deepspeed.accelerator.real_accelerator``: the accelerator DeepSpeed 0.19.8's ``get_accelerator()`` returns.

One class covers the two kinds zero-offload runs on, CUDA and the CPU, with the method names of DeepSpeed's
``CUDA_Accelerator`` and ``CPU_Accelerator``. The kind: ``DS_ACCELERATOR`` (``cuda`` or ``cpu``) where set, as
DeepSpeed reads it, else CUDA when torch sees a GPU, else the CPU. On the CPU the memory counters are this
process's resident memory (DeepSpeed's CPU accelerator reports the same: psutil's RSS), streams and events are
no-ops, and the communication backend is gloo (DeepSpeed's is ``ccl``, which zero-offload does not use).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

__all__ = ["Accelerator", "get_accelerator", "set_accelerator", "is_current_accelerator_supported"]

SUPPORTED = ("cuda", "cpu")


class _NoStream:
    """The CPU's stream and event: work is done when issued."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _NoStream()

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class Accelerator:
    """DeepSpeed's accelerator interface for ``cuda`` or ``cpu`` (``_name``, as DeepSpeed's classes)."""

    def __init__(self, name: str):
        if name not in SUPPORTED:
            raise ValueError(f"DS_ACCELERATOR={name!r}: zero-offload runs on {' or '.join(SUPPORTED)}")
        self._name = name
        self._communication_backend_name = "nccl" if name == "cuda" else "gloo"
        self._compile_backend = "inductor"

    @property
    def cuda(self) -> bool:
        return self._name == "cuda"

    # -- the device ------------------------------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        return not self.cuda

    def use_host_timers(self) -> bool:
        return not self.cuda

    def resolves_data_dependency(self) -> bool:
        return not self.cuda

    def handles_memory_backpressure(self) -> bool:
        return not self.cuda

    def device_name(self, device_index=None) -> str:
        if device_index is None or not self.cuda:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index) -> None:
        if self.cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self.cuda else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.cuda else 1

    def synchronize(self, device_index=None) -> None:
        if self.cuda:
            torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self.cuda else True

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def communication_backend_version(self):
        return torch.cuda.nccl.version() if self.cuda else None

    # -- random numbers --------------------------------------------------------------------------------
    def random(self):
        return torch.random

    def _rng(self):
        return torch.cuda if self.cuda else torch

    def set_rng_state(self, new_state, device_index=None) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    def get_rng_state(self, device_index=None):
        if self.cuda:
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def manual_seed(self, seed) -> None:
        self._rng().manual_seed(seed)

    def manual_seed_all(self, seed) -> None:
        (torch.cuda.manual_seed_all if self.cuda else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return self._rng().initial_seed()

    @property
    def default_generator(self):
        return torch.cuda.default_generators if self.cuda else [torch.default_generator]

    # -- streams and events ----------------------------------------------------------------------------
    @property
    def Stream(self):  # noqa: N802
        return torch.cuda.Stream if self.cuda else _NoStream

    def stream(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index) if self.cuda else _NoStream()

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index) if self.cuda else _NoStream()

    @property
    def Event(self):  # noqa: N802
        return torch.cuda.Event if self.cuda else _NoStream

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing() if self.cuda else False

    # -- memory ----------------------------------------------------------------------------------------
    def _rss(self) -> int:
        import psutil
        return psutil.Process().memory_info().rss

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self.cuda else self._rss()

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self.cuda else self._rss()

    def reset_max_memory_allocated(self, device_index=None) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index=None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index=None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index=None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_stats(self, device_index=None) -> dict:
        return torch.cuda.memory_stats(device_index) if self.cuda else {"allocated_bytes.all.current": self._rss()}

    def reset_peak_memory_stats(self, device_index=None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index) if self.cuda else self._rss()

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self.cuda else self._rss()

    def total_memory(self, device_index=None) -> int:
        if self.cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        import psutil
        return psutil.virtual_memory().total

    def available_memory(self, device_index=None) -> int:
        if self.cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        import psutil
        return psutil.virtual_memory().available

    def get_rss(self) -> int:
        return self._rss()

    def reset_rss(self) -> None:
        pass

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def register_host_memory(self, tensor) -> None:
        pass

    def unregister_host_memory(self, tensor) -> None:
        pass

    # -- data types ------------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self.cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float, torch.half, torch.bfloat16]

    def _tensor(self, dtype):
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    @property
    def BFloat16Tensor(self):  # noqa: N802
        return self._tensor(torch.bfloat16)

    @property
    def ByteTensor(self):  # noqa: N802
        return self._tensor(torch.uint8)

    @property
    def DoubleTensor(self):  # noqa: N802
        return self._tensor(torch.double)

    @property
    def FloatTensor(self):  # noqa: N802
        return self._tensor(torch.float)

    @property
    def HalfTensor(self):  # noqa: N802
        return self._tensor(torch.half)

    @property
    def IntTensor(self):  # noqa: N802
        return self._tensor(torch.int)

    @property
    def LongTensor(self):  # noqa: N802
        return self._tensor(torch.long)

    # -- profiling ranges, graphs, lazy calls ----------------------------------------------------------
    def range_push(self, msg) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback) -> None:
        if self.cuda:
            torch.cuda._lazy_call(callback)   # noqa: SLF001  DeepSpeed's CUDA accelerator calls the same
        else:
            callback()

    def is_triton_supported(self) -> bool:
        return False

    def create_graph(self):
        return torch.cuda.CUDAGraph() if self.cuda else None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream) if self.cuda else contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        if self.cuda:
            graph.replay()

    # -- ops and environment ---------------------------------------------------------------------------
    def op_builder_dir(self) -> str:
        return "zero_offload.deepspeed.ops.op_builder"

    def create_op_builder(self, class_name):
        from zero_offload.deepspeed.ops.op_builder import builder_for
        return builder_for(class_name)

    def get_op_builder(self, class_name):
        from zero_offload.deepspeed.ops.op_builder import builder_for
        return type(builder_for(class_name))

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension
        return BuildExtension

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self.cuda else []

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self.cuda else []

    def set_visible_devices_envs(self, current_env, local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's accelerator: ``DS_ACCELERATOR`` where set, else CUDA when available, else the CPU.

    Raises:
        ValueError: ``DS_ACCELERATOR`` names a kind other than cuda or cpu.
    """
    global _ACCELERATOR
    if _ACCELERATOR is None:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        _ACCELERATOR = Accelerator(name)
    return _ACCELERATOR


def set_accelerator(accel_obj) -> None:
    global _ACCELERATOR
    _ACCELERATOR = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in SUPPORTED
