"""zero-offload: ZeRO stages and ZeRO-Offload on PyTorch, turned on by a DeepSpeed-style JSON config.

    engine = zero_offload.initialize(model, config)
    loss = engine(x, y); engine.backward(loss); engine.step()   # engine(...) is the model's forward
"""
from zero_offload.checkpoint import CheckpointError
from zero_offload.config import Config, ConfigError
from zero_offload.checkpoint import consolidate
from zero_offload.engine import Engine, initialize
from zero_offload.estimate import estimate_memory, plan
from zero_offload.optim.cpu_adam import CPUAdam
from zero_offload.zero.stage3 import gathered_parameters, init_sharded

__version__ = "0.1.0"
__all__ = ["initialize", "Engine", "Config", "ConfigError", "CheckpointError", "CPUAdam", "consolidate",
           "gathered_parameters", "init_sharded", "estimate_memory", "plan", "__version__"]
