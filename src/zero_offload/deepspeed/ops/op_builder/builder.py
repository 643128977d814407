"""``deepspeed.ops.op_builder.builder``: DeepSpeed's CUDA/C++ extension builders. zero-offload builds its own kernels at
install time (the host Adam, the staged gradient add, the NVMe path), so a builder here loads nothing: its
``is_compatible()`` is False and ``load()`` raises, naming the op."""
from __future__ import annotations

import torch

from zero_offload.compat.unbuilt import NotBuiltError

__all__ = ["OpBuilder", "builder_for"]


class OpBuilder:
    """One DeepSpeed op (``CPUAdamBuilder``, ``FusedAdamBuilder``, ...) that zero-offload does not build."""

    def __init__(self, name: str = "op"):
        self.name = name

    @staticmethod
    def is_rocm_pytorch() -> bool:
        return getattr(torch.version, "hip", None) is not None

    def is_compatible(self, verbose: bool = False) -> bool:
        return False

    def load(self, verbose: bool = True):
        raise NotBuiltError(f"op builder {self.name}: DeepSpeed's extension ops are not built in zero-offload; its "
                            f"own optimizers (deepspeed.ops.adam.DeepSpeedCPUAdam, FusedAdam) need none")

    def builder(self):
        return self.load()


def builder_for(class_name: str) -> OpBuilder:
    return OpBuilder(class_name)


def __getattr__(name: str):   # ``from deepspeed.ops.op_builder import CPUAdamBuilder``
    if name.endswith("Builder"):
        return type(name, (OpBuilder,), {"__init__": lambda self: OpBuilder.__init__(self, name)})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
