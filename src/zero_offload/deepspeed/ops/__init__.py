"""``deepspeed.ops``: the optimizer classes DeepSpeed scripts construct themselves, under DeepSpeed's names
(`zero_offload.compat.ops`). Passed to ``deepspeed.initialize`` they run as the engine's own optimizer with their
hyper-parameters and param groups."""
from zero_offload.deepspeed.ops import adagrad, adam, lamb, lion, op_builder

__all__ = ["adam", "adagrad", "lamb", "lion", "op_builder"]
