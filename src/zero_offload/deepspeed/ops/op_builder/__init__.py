"""``deepspeed.ops.op_builder``: DeepSpeed's extension builders, none built here (`builder`)."""
from zero_offload.deepspeed.ops.op_builder import builder
from zero_offload.deepspeed.ops.op_builder.builder import OpBuilder, builder_for

__all__ = ["OpBuilder", "builder", "builder_for"]


def __getattr__(name: str):   # ``from deepspeed.ops.op_builder import CPUAdamBuilder``
    return getattr(builder, name)
