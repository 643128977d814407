"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` (`zero_offload.compat.engine`) and the names beside it."""
from typing import Callable, Union

import torch

from zero_offload.compat.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable", "MUON_OPTIMIZER",
           "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER"]

DeepSpeedOptimizerCallable = Callable[[Union[object, torch.nn.Parameter]], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], object]
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUON_OPTIMIZER = "muon"
