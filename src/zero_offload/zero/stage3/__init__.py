"""ZeRO stage 3: parameters partitioned too, gathered module by module as the model runs."""
from zero_offload.zero.stage3.gather import gathered_parameters, init_sharded
from zero_offload.zero.stage3.optimizer import Stage3Optimizer

__all__ = ["Stage3Optimizer", "gathered_parameters", "init_sharded"]
