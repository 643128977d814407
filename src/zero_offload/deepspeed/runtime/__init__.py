"""``deepspeed.runtime``: the engine, ZeRO, LR schedules, activation checkpointing and their helpers (imported
here, as DeepSpeed's package has them loaded, so ``deepspeed.runtime.lr_schedules.X`` resolves)."""
from zero_offload.deepspeed.runtime import (activation_checkpointing, base_optimizer, config, dataloader, engine,
                                            lr_schedules, utils, zero)

__all__ = ["zero", "engine", "lr_schedules", "config", "dataloader", "base_optimizer", "utils",
           "activation_checkpointing"]
