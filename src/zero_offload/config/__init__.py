"""The DeepSpeed-style JSON config as typed dataclasses, with errors that name the key at fault.

- `sections`: `Config` and its sections (zero_optimization, offload, aio); `Config.load` takes a dict, a path
  or a `Config`;
- `precision`: the fp16 and bf16 sections and the rules for bf16 master weights;
- `schema`: building dataclasses from JSON (`from_dict`, `option`) and `ConfigError`;
- `optim`: the optimizer and LR-schedule sections;
- `compat`: DeepSpeed's legacy spellings, Hugging Face ``"auto"`` values, and the tables of DeepSpeed keys
  accepted without effect or refused;
- `io`: reading a config file as DeepSpeed does;
- `keys`: those tables as docs/configs.md lists them.
"""
from zero_offload.config.auto import AutoContext
from zero_offload.config.optim import (SCHEDULER_PARAMS, AdamParams, LRRangeTestParams, OneCycleParams,
                                       OptimizerConfig, SchedulerConfig, WarmupCosineLRParams, WarmupDecayLRParams,
                                       WarmupLRParams)
from zero_offload.config.schema import ConfigError
from zero_offload.config.sections import (AioConfig, BatchSizes, BF16Config, Config, FP16Config, OffloadConfig,
                                          OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig)

__all__ = ["Config", "ConfigError", "BatchSizes", "FP16Config", "BF16Config", "OptimizerConfig",
           "SchedulerConfig", "ZeroConfig", "OffloadConfig", "AutoContext", "AdamParams", "WarmupLRParams",
           "WarmupDecayLRParams", "WarmupCosineLRParams", "OneCycleParams", "LRRangeTestParams", "SCHEDULER_PARAMS",
           "OffloadOptimizerConfig", "OffloadParamConfig", "AioConfig"]
