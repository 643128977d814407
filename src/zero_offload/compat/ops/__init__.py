"""``deepspeed.ops``: the optimizer classes DeepSpeed scripts construct themselves, under DeepSpeed's names
(``deepspeed.ops.adam.DeepSpeedCPUAdam``, ``deepspeed.ops.lamb.FusedLamb``). `zero_offload.deepspeed` exposes
this package as its ``ops`` (``import zero_offload.deepspeed as deepspeed; deepspeed.ops.adam...`` and
``from zero_offload.deepspeed.ops.adam import DeepSpeedCPUAdam`` both work). Passed to ``deepspeed.initialize``
they run as the engine's own optimizer with their hyper-parameters and param groups."""
from zero_offload.compat.ops import adagrad, adam, lamb

__all__ = ["adagrad", "adam", "lamb"]
